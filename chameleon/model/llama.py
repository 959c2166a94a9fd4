"""Functional Llama 2 and 3 (``model.arch=llama``): parameters, initialisation, stage forward, its :data:`LLAMA` spec.

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

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from chameleon.layout.spec import Rules
from chameleon.model.config import ModelConfig
from chameleon.model.spec import (
    ModelSpec,
    TensorParallelOps,
    compute_dtype,
    head_output,
    parallel_block,
    recomputed_layer,
)

INIT_STD = 0.02


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


def init_rule(cfg: ModelConfig, name: str) -> tuple[float, float]:
    """Llama's ``(mean, std)``: weights normal, std 0.02 (``wo``, ``w2``: by ``1/sqrt(2·n_layers)``); norms ones."""
    if name == "norm" or name.endswith("_norm"):
        return 1.0, 0.0
    if name.endswith(("attention.wo", "feed_forward.w2")):
        return 0.0, INIT_STD / math.sqrt(2 * cfg.n_layers)
    return 0.0, INIT_STD


def rope_frequencies(
    head_dim: int, theta: float, scaling: tuple[float, float, float, int] | None = None
) -> Tensor:
    """The rotary inverse frequencies ``theta^(-2j/head_dim)`` (fp64, ``[head_dim // 2]``), Llama-3.1-scaled.

    ``scaling = (factor, low, high, original)``: a frequency whose wavelength ``2π/f`` is below
    ``original/high`` is kept, one above ``original/low`` is divided by ``factor``, and in between
    it blends the two linearly in ``original/wavelength`` (weight 0 at ``low``, 1 at ``high``).
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    keep = ((original * inv_freq / (2 * math.pi) - low) / (high - low)).clamp(0.0, 1.0)
    return keep * inv_freq + (1 - keep) * inv_freq / factor


@functools.lru_cache(maxsize=32)
def _rotary_tables(
    seq_len: int, head_dim: int, theta: float, scaling: tuple[float, float, float, int] | None,
    device: str, dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of the rotation angles, each ``[seq_len, head_dim // 2]``."""
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), rope_frequencies(head_dim, theta, scaling))
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates interleaved pairs ``(x[2j], x[2j+1])`` of ``x`` [b, s, heads, head_dim]."""
    pairs = x.to(cos.dtype).unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.to(compute_dtype(x.dtype))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


def _reads_grouped_kv(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether SDPA's kernel reads k/v with fewer heads than q in place (``enable_gqa``, nothing copied).

    The CPU's fused kernel always does; on CUDA only flash attention does (fp16/bf16, sm80+), and
    elsewhere (fp32, say) ``enable_gqa`` would fall back to the math kernel, which keeps the ``s²``
    probabilities: there, and on any other device, k and v are repeated instead.
    """
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda":
        return False
    return torch.backends.cuda.can_use_flash_attention(torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True))


def _attention(
    params: dict[str, Tensor], cfg: ModelConfig, prefix: str, rotary: tuple[Tensor, Tensor], x: Tensor
) -> Tensor:
    wq, wk, wv, wo = (params[prefix + n] for n in ("wq", "wk", "wv", "wo"))
    head_dim = cfg.head_dim
    n_heads, n_kv = wq.shape[0] // head_dim, wk.shape[0] // head_dim
    b, s, _ = x.shape
    q = (x @ wq.T).view(b, s, n_heads, head_dim)
    k = (x @ wk.T).view(b, s, n_kv, head_dim)
    v = (x @ wv.T).view(b, s, n_kv, head_dim)
    q, k = _apply_rotary(q, *rotary), _apply_rotary(k, *rotary)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = n_kv != n_heads
    if gqa and not _reads_grouped_kv(q, k, v):
        k, v = (t.repeat_interleave(n_heads // n_kv, dim=1) for t in (k, v))
        gqa = False
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(b, s, n_heads * head_dim) @ wo.T


def _feed_forward(params: dict[str, Tensor], prefix: str, x: Tensor) -> Tensor:
    w1, w2, w3 = (params[prefix + n] for n in ("w1", "w2", "w3"))
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def _layer(params: dict[str, Tensor], cfg: ModelConfig, p: str, rotary: tuple[Tensor, Tensor],
           tp: TensorParallelOps | None, h: Tensor) -> Tensor:
    """One pre-norm block: attention, then the SwiGLU MLP, each added to the residual stream."""
    attn_in = _rms_norm(h, params[p + "attention_norm"], cfg.norm_eps)
    h = h + parallel_block(functools.partial(_attention, params, cfg, p + "attention.", rotary), attn_in, tp)
    ffn_in = _rms_norm(h, params[p + "ffn_norm"], cfg.norm_eps)
    return h + parallel_block(functools.partial(_feed_forward, params, p + "feed_forward."), ffn_in, tp)


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
    recompute: str = "none",
) -> Tensor:
    """Runs one pipeline stage: optional embedding, layers ``[start, stop)``, optional head.

    Blocks are pre-norm (RMSNorm) with rotary embeddings on q and k using Llama's
    interleaved-pair convention (dimensions ``2j`` and ``2j+1`` rotate together by angle
    ``pos · theta^(-2j/head_dim)``, Llama-3.1-scaled under ``model.rope_scaling=llama3``:
    :func:`rope_frequencies`), causal grouped-query attention (query head ``h`` reads kv
    head ``h // (n_heads / n_kv_heads)``; SDPA's ``enable_gqa``, k and v not copied where its
    kernel reads them in place, :func:`_reads_grouped_kv`) and
    a SwiGLU MLP ``w2(silu(w1 x) * w3 x)``.

    Args:
        params: The stage's parameters (full tensors, or local tensor-parallel shards).
        cfg: Model hyper-parameters.
        x: Int64 tokens ``[b, s]`` if ``first``, else hidden states ``[b, s, dim]``.
        layers: Half-open layer range ``(start, stop)``.
        first: Embed ``x`` with ``tok_embeddings``.
        last: Apply the final norm and the output projection.
        targets: Int64 ``[b, s]`` next tokens; only with ``last``.
        tp: Tensor-parallel collectives when ``params`` are shards; None means none.
        recompute: Activation recomputation (:class:`~chameleon.model.spec.Recompute`).

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
        h.shape[1], cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_params, str(h.device), compute_dtype(h.dtype)
    )
    for i in range(*layers):
        h = recomputed_layer(functools.partial(_layer, params, cfg, f"layers.{i}.", rotary, tp), h, recompute)
    if not last:
        return h
    return head_output(_rms_norm(h, params["norm"], cfg.norm_eps) @ params["output"].T, targets)


def activation_elems(cfg: ModelConfig, *, micro_batch: int, seq_len: int, recompute: str = "none") -> int:
    """Elements one block keeps for backward per micro-batch.

    Without recomputation: the inputs of the norms, q/k/v/o and the SwiGLU branches, under a fused
    attention kernel (flash or memory-efficient, on CPUs as on GPUs), which keeps no ``s²``
    probabilities. Under ``selective`` recomputation: the outputs of its matmuls and attention (q, k,
    v, attention, wo, w1, w3, w2); under ``full``: only its input.
    """
    tokens = micro_batch * seq_len
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    if recompute == "full":
        return tokens * cfg.dim
    if recompute == "selective":
        return tokens * (4 * cfg.dim + 2 * kv_dim + 2 * cfg.ffn_hidden_dim)
    return tokens * (5 * cfg.dim + 2 * kv_dim + 4 * cfg.ffn_hidden_dim)


TP_RULES: Rules = (
    (r"layers\.\d+\.attention\.w[qkv]", (Shard(0),)),
    (r"layers\.\d+\.feed_forward\.w[13]", (Shard(0),)),
    (r"layers\.\d+\.attention\.wo", (Shard(1),)),
    (r"layers\.\d+\.feed_forward\.w2", (Shard(1),)),
    (r"layers\.\d+\.(attention_norm|ffn_norm)|norm|tok_embeddings|output", (Replicate(),)),
)
"""Megatron's layout: ``(full-name regex, placements on the stage's 1-D TP mesh)``, first match wins."""

LLAMA = ModelSpec(
    name="llama",
    param_shapes=param_shapes,
    stage_param_names=stage_param_names,
    init_rule=init_rule,
    stage_forward=stage_forward,
    tp_rules=TP_RULES,
    activation_elems=activation_elems,
)
