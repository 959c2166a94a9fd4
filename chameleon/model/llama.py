"""Functional Llama-2: parameter tree, initialisation and the stage forward.

Parameters are a flat ``dict[name, Tensor]``; every function here is pure. Names are
fully qualified (``layers.7.attention.wq``) and independent of how the model is split
into pipeline stages, so a stage owns a subset of the tree and checkpoints use the same
keys. Linear weights are ``[out, in]`` (``y = x @ W.T``), as in ``torch.nn.Linear``.

Tensor parallelism uses Megatron's layout on local shards: ``wq``/``wk``/``wv``/``w1``/``w3``
are split on dim 0 (column-parallel), ``wo``/``w2`` on dim 1 (row-parallel); norms,
``tok_embeddings`` and ``output`` are replicated. The forward reads the local head counts
from the shard shapes and calls the two collectives of a :class:`TensorParallelOps`.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from chameleon.layout.memory import ELEMENT_BYTES, MemoryCosts, state_bytes_per_param
from chameleon.model.config import ModelConfig

INIT_STD = 0.02


class TensorParallelOps(Protocol):
    """The two collectives a tensor-parallel stage needs, supplied by the runtime."""

    def copy_in(self, x: Tensor) -> Tensor:
        """Identity forward; all-reduces the gradient backward."""
        ...

    def reduce_out(self, x: Tensor) -> Tensor:
        """All-reduces forward; identity backward."""
        ...


AllReduce = Callable[[Tensor], None]
"""An in-place sum of a tensor over a stage's tensor-parallel ranks."""


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, all_reduce: AllReduce) -> Tensor:
        ctx.all_reduce = all_reduce
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        ctx.all_reduce(grad)
        return grad, None


class _ReduceOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, all_reduce: AllReduce) -> Tensor:
        out = x.clone()
        all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class MegatronTP:
    """:class:`TensorParallelOps` (Megatron's f/g operators) over an all-reduce the runtime supplies.

    Args:
        all_reduce: In-place sum over the stage's tensor-parallel ranks; the model
            itself never touches a process group.
    """

    def __init__(self, all_reduce: AllReduce) -> None:
        self.all_reduce = all_reduce

    def copy_in(self, x: Tensor) -> Tensor:
        """Identity forward; all-reduces the gradient backward."""
        return _CopyIn.apply(x, self.all_reduce)

    def reduce_out(self, x: Tensor) -> Tensor:
        """All-reduces forward; identity backward."""
        return _ReduceOut.apply(x, self.all_reduce)


def _layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    q_out = cfg.n_heads * cfg.head_dim
    kv_out = cfg.n_kv_heads * cfg.head_dim
    ffn = cfg.ffn_hidden_dim
    p = f"layers.{i}."
    return {
        p + "attention_norm": (cfg.dim,),
        p + "attention.wq": (q_out, cfg.dim),
        p + "attention.wk": (kv_out, cfg.dim),
        p + "attention.wv": (kv_out, cfg.dim),
        p + "attention.wo": (cfg.dim, q_out),
        p + "ffn_norm": (cfg.dim,),
        p + "feed_forward.w1": (ffn, cfg.dim),
        p + "feed_forward.w2": (cfg.dim, ffn),
        p + "feed_forward.w3": (ffn, cfg.dim),
    }


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter, in canonical order.

    Args:
        cfg: Model hyper-parameters.

    Returns:
        ``tok_embeddings``, then each layer's tensors in layer order, then ``norm`` and
        ``output``.
    """
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings": (cfg.vocab_size, cfg.dim)}
    for i in range(cfg.n_layers):
        shapes.update(_layer_shapes(cfg, i))
    shapes["norm"] = (cfg.dim,)
    shapes["output"] = (cfg.vocab_size, cfg.dim)
    return shapes


def stage_param_names(
    cfg: ModelConfig, layers: tuple[int, int], *, first: bool, last: bool
) -> list[str]:
    """Names of the parameters owned by a stage running layers ``[start, stop)``.

    Args:
        cfg: Model hyper-parameters.
        layers: Half-open layer range ``(start, stop)``.
        first: The stage embeds tokens (owns ``tok_embeddings``).
        last: The stage produces logits (owns ``norm`` and ``output``).

    Returns:
        The names, in canonical order.

    Raises:
        ValueError: If the layer range is not within ``[0, n_layers]``.
    """
    start, stop = layers
    if not 0 <= start <= stop <= cfg.n_layers:
        raise ValueError(f"layer range {layers} not within [0, {cfg.n_layers}]")
    names = ["tok_embeddings"] if first else []
    for i in range(start, stop):
        names.extend(_layer_shapes(cfg, i))
    if last:
        names.extend(["norm", "output"])
    return names


def param_count(cfg: ModelConfig) -> int:
    """Total number of parameters of the model."""
    return sum(math.prod(s) for s in param_shapes(cfg).values())


def param_bytes(
    cfg: ModelConfig, names: Iterable[str] | None = None, *, bytes_per_elem: int = 4
) -> int:
    """Bytes taken by the named parameters (all of them when ``names`` is None).

    Args:
        cfg: Model hyper-parameters.
        names: Parameter names; None means the whole model.
        bytes_per_elem: Size of one element (4 for fp32, 2 for bf16).

    Returns:
        The number of bytes.

    Raises:
        KeyError: If a name is not a parameter of the model.
    """
    shapes = param_shapes(cfg)
    selected = shapes if names is None else names
    return bytes_per_elem * sum(math.prod(shapes[n]) for n in selected)


def unit_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """Parameter counts of one transformer layer, the embedding (first stage) and the head (last stage)."""
    count = lambda names: param_bytes(cfg, names, bytes_per_elem=1)  # noqa: E731
    layer = count(stage_param_names(cfg, (0, 1), first=False, last=False))
    first = count(stage_param_names(cfg, (0, 0), first=True, last=False))
    last = count(stage_param_names(cfg, (0, 0), first=False, last=True))
    return layer, first, last


def memory_costs(cfg: ModelConfig, *, micro_batch: int, seq_len: int, dtype: str = "fp32") -> MemoryCosts:
    """Memory of a stage's parts, counted from the shapes, with ``train.dtype`` activations.

    A block keeps the inputs of its norms, q/k/v/o and SwiGLU branches and the
    attention probabilities of the math SDPA path (``heads · seq²``); the head keeps
    its normed input and logits in ``dtype`` and the fp32 log-probabilities.
    """
    layer, first, last = unit_params(cfg)
    tokens, elem = micro_batch * seq_len, ELEMENT_BYTES[dtype]
    per_token = 8 * cfg.dim + 2 * cfg.n_kv_heads * cfg.head_dim + 3 * cfg.ffn_hidden_dim
    return MemoryCosts(
        layer_params=layer, first_params=first, last_params=last,
        layer_act_bytes=elem * (tokens * per_token + micro_batch * cfg.n_heads * seq_len * seq_len),
        first_act_bytes=0, last_act_bytes=tokens * (elem * (cfg.dim + cfg.vocab_size) + ELEMENT_BYTES["fp32"] * cfg.vocab_size),
        state_bytes_per_param=state_bytes_per_param(dtype),
    )


def _init_std(cfg: ModelConfig, name: str) -> float | None:
    """Normal std for a weight, or None for a norm (initialised to ones)."""
    if name == "norm" or name.endswith("_norm"):
        return None
    if name.endswith(("attention.wo", "feed_forward.w2")):
        return INIT_STD / math.sqrt(2 * cfg.n_layers)
    return INIT_STD


def init_params(
    cfg: ModelConfig,
    seed: int,
    *,
    names: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """Llama-style initial parameters, independent of how the model is split.

    Each tensor is drawn in fp32 on the CPU from its own generator, seeded with the CRC-32
    of its name started from ``seed`` (torch's CPU generator keeps 32 bits of its seed; for
    a fixed name distinct seeds give distinct streams), so its value does not depend on
    which other tensors are requested. Weights are normal with std 0.02 (``wo`` and ``w2``
    scaled by ``1/sqrt(2·n_layers)``); norms are ones. On the ``meta`` device nothing is
    allocated.

    Args:
        cfg: Model hyper-parameters.
        seed: Seed in ``[0, 2**32)``.
        names: The parameters to create; None means all of them.
        device: Where the tensors are placed.
        dtype: Their dtype (values are drawn in fp32, then cast).

    Returns:
        The parameters, in canonical order.

    Raises:
        ValueError: If the seed is out of range or a name is not a parameter.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    shapes = param_shapes(cfg)
    wanted = set(shapes if names is None else names)
    unknown = wanted - shapes.keys()
    if unknown:
        raise ValueError(f"not parameters of the model: {sorted(unknown)}")
    device = torch.device(device)
    params: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        if name not in wanted:
            continue
        if device.type == "meta":
            params[name] = torch.empty(shape, device=device, dtype=dtype)
            continue
        std = _init_std(cfg, name)
        if std is None:
            params[name] = torch.ones(shape, device=device, dtype=dtype)
            continue
        gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode(), seed))
        value = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        params[name] = value.to(device=device, dtype=dtype)
    return params


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and rotations run in at least fp32 (bf16/fp16 are upcast, fp64 is kept)."""
    return torch.promote_types(dtype, torch.float32)


@functools.lru_cache(maxsize=32)
def _rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: str, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of the rotation angles, each ``[seq_len, head_dim // 2]``."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates interleaved pairs ``(x[2j], x[2j+1])`` of ``x`` [b, s, heads, head_dim]."""
    pairs = x.to(cos.dtype).unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.to(_compute_dtype(x.dtype))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


def _attention(
    params: dict[str, Tensor],
    cfg: ModelConfig,
    x: Tensor,
    prefix: str,
    rotary: tuple[Tensor, Tensor],
    tp: TensorParallelOps | None,
) -> Tensor:
    wq, wk, wv, wo = (params[prefix + n] for n in ("wq", "wk", "wv", "wo"))
    head_dim = cfg.head_dim
    n_heads, n_kv = wq.shape[0] // head_dim, wk.shape[0] // head_dim
    if tp is not None:
        x = tp.copy_in(x)
    b, s, _ = x.shape
    q = (x @ wq.T).view(b, s, n_heads, head_dim)
    k = (x @ wk.T).view(b, s, n_kv, head_dim)
    v = (x @ wv.T).view(b, s, n_kv, head_dim)
    q, k = _apply_rotary(q, *rotary), _apply_rotary(k, *rotary)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if n_kv != n_heads:
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = out.transpose(1, 2).reshape(b, s, n_heads * head_dim) @ wo.T
    return out if tp is None else tp.reduce_out(out)


def _feed_forward(
    params: dict[str, Tensor], x: Tensor, prefix: str, tp: TensorParallelOps | None
) -> Tensor:
    w1, w2, w3 = (params[prefix + n] for n in ("w1", "w2", "w3"))
    if tp is not None:
        x = tp.copy_in(x)
    out = (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
    return out if tp is None else tp.reduce_out(out)


def stage_forward(
    params: dict[str, Tensor],
    cfg: ModelConfig,
    x: Tensor,
    *,
    layers: tuple[int, int],
    first: bool,
    last: bool,
    targets: Tensor | None = None,
    tp: TensorParallelOps | None = None,
) -> Tensor:
    """Runs one pipeline stage: optional embedding, layers ``[start, stop)``, optional head.

    Blocks are pre-norm (RMSNorm) with rotary embeddings on q and k using Llama's
    interleaved-pair convention (dimensions ``2j`` and ``2j+1`` rotate together by angle
    ``pos · theta^(-2j/head_dim)``), causal grouped-query attention (kv heads repeated
    when ``n_kv_heads < n_heads``) and a SwiGLU MLP ``w2(silu(w1 x) * w3 x)``.

    Args:
        params: The stage's parameters (full tensors, or local tensor-parallel shards).
        cfg: Model hyper-parameters.
        x: Int64 tokens ``[b, s]`` if ``first``, else hidden states ``[b, s, dim]``.
        layers: Half-open layer range ``(start, stop)``.
        first: Embed ``x`` with ``tok_embeddings``.
        last: Apply the final norm and the output projection.
        targets: Int64 ``[b, s]`` next tokens; only with ``last``.
        tp: Tensor-parallel collectives when ``params`` are shards; None means none.

    Returns:
        Hidden states ``[b, s, dim]`` if not ``last``; else logits ``[b, s, vocab]``, or,
        with ``targets``, the cross-entropy summed over all ``b · s`` tokens (0-d fp32).

    Raises:
        ValueError: If ``targets`` is given to a stage that is not ``last``.
    """
    if targets is not None and not last:
        raise ValueError("targets are only accepted by the last stage")
    h = F.embedding(x, params["tok_embeddings"]) if first else x
    rotary = _rotary_tables(
        h.shape[1], cfg.head_dim, cfg.rope_theta, str(h.device), _compute_dtype(h.dtype)
    )
    for i in range(*layers):
        p = f"layers.{i}."
        attn_in = _rms_norm(h, params[p + "attention_norm"], cfg.norm_eps)
        h = h + _attention(params, cfg, attn_in, p + "attention.", rotary, tp)
        ffn_in = _rms_norm(h, params[p + "ffn_norm"], cfg.norm_eps)
        h = h + _feed_forward(params, ffn_in, p + "feed_forward.", tp)
    if not last:
        return h
    logits = _rms_norm(h, params["norm"], cfg.norm_eps) @ params["output"].T
    if targets is None:
        return logits
    return F.cross_entropy(
        logits.flatten(0, 1).to(_compute_dtype(logits.dtype)), targets.flatten(), reduction="sum"
    )


def full_forward_loss(
    params: dict[str, Tensor], cfg: ModelConfig, tokens: Tensor, targets: Tensor
) -> Tensor:
    """Cross-entropy of the whole model, summed over all tokens (0-d).

    Args:
        params: All parameters.
        cfg: Model hyper-parameters.
        tokens: Int64 ``[b, s]`` inputs.
        targets: Int64 ``[b, s]`` next tokens.

    Returns:
        The summed loss; divide by ``b · s`` for the mean.
    """
    return stage_forward(
        params, cfg, tokens, layers=(0, cfg.n_layers), first=True, last=True, targets=targets
    )
