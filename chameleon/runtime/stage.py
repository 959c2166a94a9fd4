"""A device's stage in a plan and its training state: parameter shards and AdamW moments."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chameleon.layout.plan import Plan, Stage
from chameleon.layout.spec import Region, placements_for, shard_region
from chameleon.model.config import ModelConfig
from chameleon.model.llama import init_params, stage_param_names

KINDS = ("param", "exp_avg", "exp_avg_sq")


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
    names = stage_param_names(model, role.spec.layers, first=role.first, last=role.last)
    return {n: shard_region(shapes[n], placements_for(n), role.tp_index, role.spec.tp) for n in names}


@dataclass
class StageState:
    """Parameter shards of one stage and their AdamW optimizer."""

    params: dict[str, torch.Tensor]
    regions: dict[str, Region]
    optimizer: torch.optim.AdamW
    device: torch.device

    @classmethod
    def create(cls, model: ModelConfig, role: Role, *, seed: int, train: dict, device: torch.device) -> StageState:
        """Fresh state: this device's shards of the single-process initialisation, zero moments."""
        names = stage_param_names(model, role.spec.layers, first=role.first, last=role.last)
        full = init_params(model, seed, names=names)
        regions = stage_regions(model, role, {n: tuple(t.shape) for n, t in full.items()})
        params = {n: t[tuple(slice(a, b) for a, b in regions[n])] for n, t in full.items()}
        zeros = {n: torch.zeros_like(t) for n, t in params.items()}
        return cls.from_tensors({"param": params, "exp_avg": zeros, "exp_avg_sq": dict(zeros)}, regions,
                                committed_steps=0, train=train, device=device)

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, dict[str, torch.Tensor]], regions: dict[str, Region], *,
        committed_steps: int, train: dict, device: torch.device,
    ) -> StageState:
        """State from per-kind shards (a re-layout or a checkpoint), AdamW resumed at ``committed_steps``."""
        params = {n: tensors["param"][n].detach().clone().to(device).requires_grad_(True) for n in regions}
        optimizer = torch.optim.AdamW(
            list(params.values()), lr=train["lr"], betas=(train["beta1"], train["beta2"]),
            eps=train["eps"], weight_decay=train["weight_decay"],
        )
        for n, p in params.items():
            optimizer.state[p] = {
                "step": torch.tensor(float(committed_steps)),
                "exp_avg": tensors["exp_avg"][n].detach().clone().to(device),
                "exp_avg_sq": tensors["exp_avg_sq"][n].detach().clone().to(device),
            }
        return cls(params=params, regions=regions, optimizer=optimizer, device=device)

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per kind (param, exp_avg, exp_avg_sq), this device's shard of every tensor (views, CPU)."""
        out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
        for n, p in self.params.items():
            st = self.optimizer.state[p]
            out["param"][n] = p.detach().cpu()
            out["exp_avg"][n] = st["exp_avg"].cpu()
            out["exp_avg_sq"][n] = st["exp_avg_sq"].cpu()
        return out

    def grads(self, names: tuple[str, ...] | list[str]) -> list[torch.Tensor]:
        """Gradients of ``names`` (zeros where a parameter got none)."""
        out = []
        for n in names:
            p = self.params[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def discard_gradients(self) -> None:
        """Drop an abandoned step's gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def shards(self) -> dict[str, tuple[Region, torch.Tensor]]:
        """A CPU copy of this device's parameter shards with the region each covers."""
        return {n: (self.regions[n], p.detach().to("cpu").clone()) for n, p in self.params.items()}
