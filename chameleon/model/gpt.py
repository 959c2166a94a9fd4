"""Functional GPT-2-style decoder (``model.arch=gpt``) and its :data:`GPT` spec.

Pre-norm blocks with LayerNorm (weight and bias), learned absolute position
embeddings, causal multi-head attention with separate q/k/v projections, a biased
GELU (tanh) MLP of width ``4·dim`` and an untied, bias-free output head. q, v and
the output projection have biases; k has none (as in Whisper): a key bias adds
``q·b`` to all of a query's scores, which softmax ignores, so its gradient would be
rounding noise that Adam amplifies into values that differ between layouts.
It reads ``dim``, ``n_layers``, ``n_heads``, ``vocab_size``, ``max_seq_len`` (rows of
the position table) and ``norm_eps`` of :class:`ModelConfig`; the other fields are
Llama's and ignored (config validation still asks that ``parallel.tp`` divide
``n_kv_heads``, so ``conf/model/gpt_tiny.yaml`` sets it to ``n_heads``).

Tensor parallelism follows Megatron as Llama's does: q/k/v and the MLP's ``w1`` are
split on dim 0 with their biases, the ``wo`` and ``w2`` weights on dim 1; the latter's
biases are added once after the all-reduce, so they are replicated like the norms,
the embeddings and the head.
"""

from __future__ import annotations

import math
from functools import partial

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


def _norm_shapes(name: str, dim: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (dim,), f"{name}.bias": (dim,)}


def _linear_shapes(name: str, out: int, inp: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (out, inp), f"{name}.bias": (out,)}


def _layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    p, dim = f"layers.{i}.", cfg.dim
    return {
        **_norm_shapes(p + "attention_norm", dim),
        **_linear_shapes(p + "attention.wq", dim, dim),
        p + "attention.wk.weight": (dim, dim),
        **_linear_shapes(p + "attention.wv", dim, dim),
        **_linear_shapes(p + "attention.wo", dim, dim),
        **_norm_shapes(p + "ffn_norm", dim),
        **_linear_shapes(p + "feed_forward.w1", 4 * dim, dim),
        **_linear_shapes(p + "feed_forward.w2", dim, 4 * dim),
    }


def _embedding_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {"tok_embeddings": (cfg.vocab_size, cfg.dim), "pos_embeddings": (cfg.max_seq_len, cfg.dim)}


def _head_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {**_norm_shapes("norm", cfg.dim), "output": (cfg.vocab_size, cfg.dim)}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter: the embeddings, each layer's tensors in layer order, the final norm and head."""
    shapes = _embedding_shapes(cfg)
    for i in range(cfg.n_layers):
        shapes.update(_layer_shapes(cfg, i))
    return {**shapes, **_head_shapes(cfg)}


def stage_param_names(cfg: ModelConfig, layers: tuple[int, int], *, first: bool, last: bool) -> list[str]:
    """Names a stage running layers ``[start, stop)`` owns, in canonical order (``first``: embeddings, ``last``: head).

    Raises:
        ValueError: If the layer range is not within ``[0, n_layers]``.
    """
    start, stop = layers
    if not 0 <= start <= stop <= cfg.n_layers:
        raise ValueError(f"layer range {layers} not within [0, {cfg.n_layers}]")
    names = list(_embedding_shapes(cfg)) if first else []
    for i in range(start, stop):
        names.extend(_layer_shapes(cfg, i))
    return names + (list(_head_shapes(cfg)) if last else [])


def init_rule(cfg: ModelConfig, name: str) -> tuple[float, float]:
    """GPT-2's ``(mean, std)``: weights and embeddings normal with std 0.02 (``wo``/``w2`` by ``1/sqrt(2·n_layers)``),
    biases zeros, norm weights ones."""
    if name.endswith(".bias"):
        return 0.0, 0.0
    if name.endswith("norm.weight"):
        return 1.0, 0.0
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return 0.0, INIT_STD / math.sqrt(2 * cfg.n_layers)
    return 0.0, INIT_STD


def _layer_norm(params: dict[str, Tensor], name: str, x: Tensor, eps: float) -> Tensor:
    xf = x.to(compute_dtype(x.dtype))
    weight, bias = (params[f"{name}.{k}"].to(xf.dtype) for k in ("weight", "bias"))
    return F.layer_norm(xf, xf.shape[-1:], weight, bias, eps).type_as(x)


def _attention(params: dict[str, Tensor], head_dim: int, prefix: str, x: Tensor) -> Tensor:
    """Causal attention over this rank's heads; the output projection's bias is left to the caller."""
    b, s, _ = x.shape
    projected = (F.linear(x, params[f"{prefix}w{n}.weight"], params.get(f"{prefix}w{n}.bias")) for n in "qkv")
    q, k, v = (t.view(b, s, -1, head_dim).transpose(1, 2) for t in projected)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).flatten(2) @ params[prefix + "wo.weight"].T


def _mlp(params: dict[str, Tensor], prefix: str, x: Tensor) -> Tensor:
    """``w2(gelu(w1 x + b1))`` over this rank's hidden units; ``w2``'s bias is left to the caller."""
    hidden = F.gelu(F.linear(x, params[prefix + "w1.weight"], params[prefix + "w1.bias"]), approximate="tanh")
    return hidden @ params[prefix + "w2.weight"].T


def _layer(params: dict[str, Tensor], cfg: ModelConfig, p: str, tp: TensorParallelOps | None, h: Tensor) -> Tensor:
    """One pre-LayerNorm block: attention, then the GELU MLP, each added (with its output bias) to the residual."""
    attn_in = _layer_norm(params, p + "attention_norm", h, cfg.norm_eps)
    h = h + parallel_block(partial(_attention, params, cfg.head_dim, p + "attention."), attn_in, tp)
    h = h + params[p + "attention.wo.bias"]
    mlp_in = _layer_norm(params, p + "ffn_norm", h, cfg.norm_eps)
    h = h + parallel_block(partial(_mlp, params, p + "feed_forward."), mlp_in, tp)
    return h + params[p + "feed_forward.w2.bias"]


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

    Args and returns as Llama's (:func:`chameleon.model.llama.stage_forward`): tokens or
    hidden states in; hidden states, logits, or with ``targets`` the summed loss out.

    Raises:
        ValueError: If ``targets`` is given to a stage that is not ``last``.
    """
    if targets is not None and not last:
        raise ValueError("targets are only accepted by the last stage")
    h = F.embedding(x, params["tok_embeddings"]) + params["pos_embeddings"][: x.shape[1]] if first else x
    for i in range(*layers):
        h = recomputed_layer(partial(_layer, params, cfg, f"layers.{i}.", tp), h, recompute)
    if not last:
        return h
    return head_output(_layer_norm(params, "norm", h, cfg.norm_eps) @ params["output"].T, targets)


def activation_elems(cfg: ModelConfig, *, micro_batch: int, seq_len: int, recompute: str = "none") -> int:
    """Elements one block keeps for backward per micro-batch: per token its two norms' inputs and outputs,
    q/k/v, the attention output and the MLP's hidden units before and after GELU (``16·dim``; the fused
    attention kernel keeps no probabilities). Under ``selective`` recomputation: the outputs of its matmuls
    and attention (q, k, v, attention, wo, w1, w2: ``10·dim``); under ``full``: its input."""
    tokens = micro_batch * seq_len
    return tokens * cfg.dim * {"none": 16, "selective": 10, "full": 1}[recompute]


TP_RULES: Rules = (
    (r"layers\.\d+\.attention\.w[qkv]\.(weight|bias)", (Shard(0),)),
    (r"layers\.\d+\.feed_forward\.w1\.(weight|bias)", (Shard(0),)),
    (r"layers\.\d+\.(attention\.wo|feed_forward\.w2)\.weight", (Shard(1),)),
    (r"layers\.\d+\.(attention\.wo|feed_forward\.w2)\.bias", (Replicate(),)),
    (r"(layers\.\d+\.(attention_norm|ffn_norm)|norm)\.(weight|bias)", (Replicate(),)),
    (r"tok_embeddings|pos_embeddings|output", (Replicate(),)),
)
"""Megatron's layout for GPT: ``(full-name regex, placements on the stage's 1-D TP mesh)``, first match wins."""

GPT = ModelSpec(
    name="gpt",
    param_shapes=param_shapes,
    stage_param_names=stage_param_names,
    init_rule=init_rule,
    stage_forward=stage_forward,
    tp_rules=TP_RULES,
    activation_elems=activation_elems,
)
