"""A device's stage in a plan and its training state: fp32 master parameter shards and AdamW moments."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from chameleon.config import TrainConfig
from chameleon.layout.plan import Plan, Stage
from chameleon.layout.spec import Region, local_slices, placements_for, shard_region
from chameleon.model.config import ModelConfig
from chameleon.model.hf import hf_checkpoint, load_hf
from chameleon.model.spec import spec_of
from chameleon.optim import adamw_, clip_coefficient, hyperparameters, init_moments, scale_, sum_of_squares
from chameleon.runtime.checkpoint import checksum
from chameleon.schedule import learning_rate, schedule_of

KINDS = ("param", "exp_avg", "exp_avg_sq")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # train.dtype → the forward's dtype


@dataclass(frozen=True)
class Role:
    """Where one device sits in a plan: pipeline, stage and TP index."""

    device: int
    pipeline: int
    stage: int
    tp_index: int
    spec: Stage
    n_stages: int

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1


def role_of(plan: Plan, device: int) -> Role | None:
    """The role of ``device`` in ``plan``, or ``None`` when the plan does not use it."""
    for j, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            if device in stage.devices:
                return Role(device, j, s, stage.devices.index(device), stage, pipe.n_stages)
    return None


def stage_regions(model: ModelConfig, role: Role, shapes: dict[str, tuple[int, ...]]) -> dict[str, Region]:
    """The region of every tensor this role's device holds (its TP shard)."""
    spec = spec_of(model)
    names = spec.stage_param_names(model, role.spec.layers, first=role.first, last=role.last)
    return {n: shard_region(shapes[n], placements_for(n, rules=spec.tp_rules), role.tp_index, role.spec.tp) for n in names}


class StageState:
    """One stage's training state on its device: fp32 master parameters and AdamW moments.

    The state is three trees, one per kind of :data:`KINDS` (``param`` holds the fp32
    masters); it is what re-layouts move and checkpoints store. ``params`` are the
    tensors the forward reads: the masters themselves under ``train.dtype=fp32``, or
    their bf16 copies under ``bf16``, cast once per step. Either way the gradients
    accumulate over micro-batches in fp32, on the masters (the cast's backward
    upcasts), so the gradient sync, the global norm and AdamW all run in fp32.

    Args:
        tensors: per kind, this device's shard of every tensor in ``regions``.
        regions: the global region of each tensor this device holds.
        train: the ``train`` config (optimizer, schedule, clipping, dtype).
        device: where every tensor lives (CPU, or an accelerator: no host copies).
    """

    def __init__(self, tensors: Mapping[str, Mapping[str, Tensor]], regions: dict[str, Region], *, train: TrainConfig,
                 device: torch.device):
        self.regions, self.train, self.device = regions, train, device
        self.compute_dtype = DTYPES[train.dtype]
        self._state = {kind: {n: _owned(tensors[kind][n], device) for n in regions} for kind in KINDS}
        self._new_step()

    @classmethod
    def create(cls, model: ModelConfig, role: Role, *, seed: int, train: TrainConfig, device: torch.device) -> StageState:
        """Fresh state: this device's shards of the initial parameters (``model.init``), zero moments."""
        spec = spec_of(model)
        names = spec.stage_param_names(model, role.spec.layers, first=role.first, last=role.last)
        source = hf_checkpoint(model.init)
        full = spec.init_params(model, seed, names=names) if source is None else load_hf(source, model, names=names)
        regions = stage_regions(model, role, {n: tuple(t.shape) for n, t in full.items()})
        params = {n: t[tuple(slice(a, b) for a, b in regions[n])] for n, t in full.items()}
        return cls({"param": params, **init_moments(params)}, regions, train=train, device=device)

    def tensors(self) -> dict[str, dict[str, Tensor]]:
        """Per kind (param, exp_avg, exp_avg_sq), this device's shard of every tensor, on its device."""
        return {kind: dict(tree) for kind, tree in self._state.items()}

    def grads(self, names: tuple[str, ...] | list[str]) -> list[Tensor]:
        """The fp32 gradients of ``names`` (zeros where a parameter got none)."""
        out = []
        for n in names:
            leaf = self._leaves[n]
            if leaf.grad is None:
                leaf.grad = torch.zeros_like(leaf)
            out.append(leaf.grad)
        return out

    def grad_sum_of_squares(self, regions: Mapping[str, Region]) -> Tensor:
        """``Σ ‖g‖²`` of this device's gradients over ``regions`` (global regions, each inside a held one)."""
        pieces = (g[local_slices(regions[n], self.regions[n])] for n, g in zip(regions, self.grads(list(regions))))
        return sum_of_squares(pieces, device=self.device)

    def grads_finite(self) -> Tensor:
        """Whether every gradient this device holds is finite (``Σ‖g‖²`` overflowing counts as not), as a 1-element
        bool tensor on the device (read with the step's other figures: no host read of its own)."""
        return torch.isfinite(sum_of_squares(self.grads(list(self.regions)), device=self.device))

    def on_gradient(self, names: Iterable[str], hook: Callable[[str], None]) -> list[RemovableHandle]:
        """Call ``hook(name)`` each time a gradient of ``names`` has accumulated (until the handles are removed)."""
        return [self._leaves[n].register_post_accumulate_grad_hook(lambda _, n=n: hook(n)) for n in names]

    def digest(self, slot: int, slots: int) -> int:
        """CRC-32 of the parameters and both moments of every ``slots``-th tensor this device holds (by name) from
        ``slot``: replicas of the same regions give the same digest, or their state has diverged."""
        value = 0
        for name in sorted(self.regions)[slot::slots]:
            for kind in KINDS:
                value = checksum(self._state[kind][name], value)
        return value

    def corrupt(self, target: str, value: str) -> None:
        """``failure.kind=corrupt``: one element of this device's first tensor's gradient (``target=grad``) or
        parameter (``param``) made ``nan`` or ``inf``, or its lowest bit flipped (``flip``)."""
        name = next(iter(self.regions))
        element = (self.grads([name])[0] if target == "grad" else self._state["param"][name]).view(-1)[:1]
        if value == "flip":
            element.view(torch.int32).bitwise_xor_(1)
        else:
            element.fill_(float(value))

    def discard_gradients(self) -> None:
        """Drop an abandoned step's gradients (and its bf16 copies' graph)."""
        self._new_step()

    def optimizer_step(self, step: int, *, grad_norm: float | None = None) -> None:
        """Apply AdamW for global step ``step`` (0-based) at that step's learning rate.

        Args:
            step: the global step; sets the learning rate and AdamW's bias correction.
            grad_norm: the global gradient norm; with ``train.clip_norm > 0`` the
                gradients are scaled by :func:`clip_coefficient` first.
        """
        names = list(self.regions)
        grads = self.grads(names)
        scale_(grads, clip_coefficient(grad_norm, self.train.clip_norm) if grad_norm is not None else 1.0)
        held = {kind: [self._state[kind][n] for n in names] for kind in KINDS}
        adamw_(held["param"], grads, held["exp_avg"], held["exp_avg_sq"], step + 1,
               lr=learning_rate(step, **schedule_of(self.train)), **hyperparameters(self.train))
        self._new_step()

    def shards(self) -> dict[str, tuple[Region, Tensor]]:
        """A CPU copy of this device's master parameter shards with the region each covers."""
        return {n: (self.regions[n], p.detach().to("cpu", copy=True)) for n, p in self._state["param"].items()}

    def _new_step(self) -> None:
        """Fresh gradient leaves over the masters and the forward's tensors (their casts) for the next step."""
        self._leaves = {n: p.detach().requires_grad_(True) for n, p in self._state["param"].items()}
        self.params = {n: leaf.to(self.compute_dtype) for n, leaf in self._leaves.items()}


def _owned(tensor: Tensor, device: torch.device) -> Tensor:
    """An fp32 copy of ``tensor`` on ``device`` that shares memory with nothing else."""
    return tensor.detach().to(device=device, dtype=torch.float32, copy=True)
