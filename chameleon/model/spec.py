"""Model descriptions: one :class:`ModelSpec` per architecture, chosen by ``model.arch``.

A spec holds what the rest of Chameleon needs to know about an architecture: its
parameter tree (names, shapes, which stage owns which), how each tensor is
initialised, the pure stage forward, the tensor-parallel sharding rules and
collectives, and the costs the memory check and the analytic profile count. The
runtime, the config validation, the profiler and the layout code reach the model
only through :func:`spec_of`; adding an architecture is one file defining a spec
plus its line in :func:`_registry`.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from chameleon.layout.geometry import ELEMENT_BYTES, UnitParams, state_bytes
from chameleon.layout.memory import DeviceOverheads, LayerActivations, MemoryCosts
from chameleon.layout.plan import Plan, Recompute
from chameleon.layout.spec import Layout, Rules, layout_of
from chameleon.model.config import ModelConfig


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


def parallel_block(block: Callable[[Tensor], Tensor], x: Tensor, tp: TensorParallelOps | None) -> Tensor:
    """``block(x)`` for a Megatron block: its input copied in, its partial output summed over the TP ranks."""
    return block(x) if tp is None else tp.reduce_out(block(tp.copy_in(x)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, rotations and the loss run in at least fp32 (bf16/fp16 are upcast, fp64 is kept)."""
    return torch.promote_types(dtype, torch.float32)


def head_output(logits: Tensor, targets: Tensor | None) -> Tensor:
    """The logits, or with ``targets`` the cross-entropy summed over all tokens (0-d, at least fp32)."""
    if targets is None:
        return logits
    return F.cross_entropy(
        logits.flatten(0, 1).to(compute_dtype(logits.dtype)), targets.flatten(), reduction="sum"
    )


SAVED_BY_SELECTIVE = frozenset(
    getattr(torch.ops.aten, name).default for name in (
        "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    )
)


def _selective(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def recomputed_layer(layer: Callable[[Tensor], Tensor], h: Tensor, recompute: str) -> Tensor:
    """``layer(h)`` under ``recompute`` (:class:`Recompute`) while autograd records: ``full`` keeps only ``h`` and
    reruns the layer in backward; ``selective`` also keeps its matmul and attention outputs (op-level
    selective checkpointing) and reruns the rest."""
    if recompute == "none" or not torch.is_grad_enabled():
        return layer(h)
    if recompute == "full":
        return checkpoint(layer, h, use_reentrant=False)
    return checkpoint(layer, h, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, _selective))


def dense_decoder_flops(cfg: ModelConfig, seq_len: int, layer_params: int) -> tuple[float, float, float]:
    """A dense decoder's forward FLOPs per token: ``2·P + 2·s·dim`` a layer of ``P`` parameters at
    context ``s``, 0 the embedding (a lookup), ``2·vocab·dim`` the head."""
    return 2 * layer_params + 2 * seq_len * cfg.dim, 0.0, 2 * cfg.vocab_size * cfg.dim


@dataclass(frozen=True)
class ModelSpec:
    """One architecture: its parameter tree, forward, TP sharding and costs.

    Every callable takes the :class:`ModelConfig` first. Parameters are a flat
    ``dict[name, Tensor]`` with fully qualified names independent of the pipeline
    split; linear weights are ``[out, in]``.

    Attributes:
        name: The ``model.arch`` value that selects this spec.
        param_shapes: ``(cfg) -> {name: shape}`` of every parameter, in canonical order.
        stage_param_names: ``(cfg, (start, stop), *, first, last) -> names`` a stage owns;
            ``first`` embeds, ``last`` holds the final norm and the head.
        init_rule: ``(cfg, name) -> (mean, std)`` of a tensor's initial values (std 0: a constant).
        stage_forward: ``(params, cfg, x, *, layers, first, last, targets=None, tp=None, recompute="none")``:
            tokens or hidden states in; hidden states, logits or the summed loss out (``recompute``:
            one of :class:`Recompute`, each layer through :func:`recomputed_layer`).
        tp_rules: Full-name regex → DTensor placements on a stage's 1-D TP mesh, first match wins.
        activation_elems: ``(cfg, *, micro_batch, seq_len, recompute="none") -> elements`` one layer
            keeps for backward per micro-batch (under a fused attention kernel: no ``s²`` probabilities).
        tp_ops: Builds the :class:`TensorParallelOps` from the runtime's all-reduce (Megatron's).
        forward_flops: ``(cfg, seq_len, layer_params) -> (layer, first, last)`` forward FLOPs per
            token of one layer at context ``seq_len``, of the first stage's embedding and of the
            head (:func:`dense_decoder_flops` for a dense decoder).
    """

    name: str
    param_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    stage_param_names: Callable[..., list[str]]
    init_rule: Callable[[ModelConfig, str], tuple[float, float]]
    stage_forward: Callable[..., Tensor]
    tp_rules: Rules
    activation_elems: Callable[..., int]
    tp_ops: Callable[[AllReduce], TensorParallelOps] = MegatronTP
    forward_flops: Callable[[ModelConfig, int, int], tuple[float, float, float]] = dense_decoder_flops

    def init_params(
        self,
        cfg: ModelConfig,
        seed: int,
        *,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> dict[str, Tensor]:
        """Initial parameters, independent of how the model is split.

        Each tensor is drawn in fp32 on the CPU from its own generator, seeded with the CRC-32
        of its name started from ``seed`` (torch's CPU generator keeps 32 bits of its seed; for
        a fixed name distinct seeds give distinct streams), so its value does not depend on
        which other tensors are requested; :attr:`init_rule` gives its mean and std. On the
        ``meta`` device nothing is allocated.

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
        shapes = self.param_shapes(cfg)
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
            mean, std = self.init_rule(cfg, name)
            if std == 0:
                params[name] = torch.full(shape, mean, device=device, dtype=dtype)
                continue
            gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode(), seed))
            value = torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=gen)
            params[name] = value.to(device=device, dtype=dtype)
        return params

    def full_forward_loss(self, params: dict[str, Tensor], cfg: ModelConfig, tokens: Tensor, targets: Tensor) -> Tensor:
        """Cross-entropy of the whole model summed over all ``b · s`` tokens (0-d); divide for the mean."""
        return self.stage_forward(
            params, cfg, tokens, layers=(0, cfg.n_layers), first=True, last=True, targets=targets
        )

    def param_count(self, cfg: ModelConfig) -> int:
        """Total number of parameters of the model."""
        return sum(math.prod(s) for s in self.param_shapes(cfg).values())

    def param_bytes(self, cfg: ModelConfig, names: Iterable[str] | None = None, *, bytes_per_elem: int = 4) -> int:
        """Bytes taken by the named parameters (all of them when ``names`` is None).

        Raises:
            KeyError: If a name is not a parameter of the model.
        """
        shapes = self.param_shapes(cfg)
        selected = shapes if names is None else names
        return bytes_per_elem * sum(math.prod(shapes[n]) for n in selected)

    def unit_params(self, cfg: ModelConfig) -> UnitParams:
        """Parameter counts of one layer, the embedding (first stage) and the head (last stage)."""
        count = partial(self.param_bytes, cfg, bytes_per_elem=1)
        layer = count(self.stage_param_names(cfg, (0, 1), first=False, last=False))
        first = count(self.stage_param_names(cfg, (0, 0), first=True, last=False))
        last = count(self.stage_param_names(cfg, (0, 0), first=False, last=True))
        return UnitParams(layer, first, last)

    def layer_activations(self, cfg: ModelConfig, *, micro_batch: int, seq_len: int,
                          recompute: str = "none") -> tuple[int, int]:
        """Elements one layer keeps per micro-batch until its backward under ``recompute``, and those its
        backward rebuilds at once (one layer's worth: what it would have kept, less what it kept)."""
        kept = self.activation_elems(cfg, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute)
        return kept, self.activation_elems(cfg, micro_batch=micro_batch, seq_len=seq_len) - kept

    def head_work(self, cfg: ModelConfig, *, micro_batch: int, seq_len: int) -> int:
        """Bytes the loss makes for a while on the last stage: its fp32 working copy of the logits and their
        gradient (:attr:`MemoryCosts.head_work`)."""
        return 2 * micro_batch * seq_len * cfg.vocab_size * ELEMENT_BYTES["fp32"]

    def memory_costs(self, cfg: ModelConfig, *, micro_batch: int, seq_len: int, dtype: str = "fp32",
                     recompute: str = "none", overheads: DeviceOverheads = DeviceOverheads()) -> MemoryCosts:
        """Memory of a stage's parts, counted from the shapes, with ``train.dtype`` activations.

        A layer keeps :meth:`layer_activations` under ``recompute`` (and under each other recomputation, for a
        stage that has it: :meth:`MemoryCosts.under`); the head keeps its normed input and logits in ``dtype`` and
        the fp32 log-probabilities, and its loss works in :meth:`head_work`; ``overheads`` are the device's.
        """
        tokens, elem = micro_batch * seq_len, ELEMENT_BYTES[dtype]
        layers_under = tuple(
            LayerActivations(mode, *(elem * n for n in self.layer_activations(cfg, micro_batch=micro_batch,
                                                                                seq_len=seq_len, recompute=mode)))
            for mode in Recompute
        )
        acts = UnitParams(
            layer=0, first=0,
            last=tokens * (elem * (cfg.dim + cfg.vocab_size) + ELEMENT_BYTES["fp32"] * cfg.vocab_size),
        )
        return MemoryCosts(self.unit_params(cfg), acts, state_bytes(dtype).resident, layers_under=layers_under,
                           head_work=self.head_work(cfg, micro_batch=micro_batch, seq_len=seq_len),
                           overheads=overheads).under(recompute)

    def layout(self, cfg: ModelConfig, plan: Plan) -> Layout:
        """Every parameter of the model under ``plan``, sharded by :attr:`tp_rules`."""
        return layout_of(plan, self.param_shapes(cfg), partial(self.stage_param_names, cfg), rules=self.tp_rules)


@functools.cache
def _registry() -> dict[str, ModelSpec]:
    """Every architecture by ``model.arch``; a new one adds its line here (imported late: they import this module)."""
    from chameleon.model.gpt import GPT
    from chameleon.model.llama import LLAMA

    return {spec.name: spec for spec in (LLAMA, GPT)}


def spec_of(cfg: ModelConfig) -> ModelSpec:
    """The spec of the architecture ``cfg.arch`` names.

    Raises:
        ValueError: An unknown ``model.arch``, naming the known ones.
    """
    specs = _registry()
    if cfg.arch not in specs:
        raise ValueError(f"model.arch={cfg.arch!r}: use one of {', '.join(sorted(specs))}")
    return specs[cfg.arch]
