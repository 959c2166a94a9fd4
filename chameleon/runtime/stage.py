"""A worker's role in a plan and the training state of its stage (parameters, AdamW)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chameleon.layout.plan import Plan, Stage
from chameleon.layout.spec import Region, local_slices, placements_for, shard_region
from chameleon.model.config import ModelConfig
from chameleon.model.llama import init_params, stage_param_names


@dataclass(frozen=True)
class Role:
    """Where one device sits in a plan: pipeline, stage, TP index and its neighbours."""

    device: int
    pipeline: int
    stage: int
    tp_index: int
    spec: Stage
    n_stages: int
    prev_devices: tuple[int, ...]
    next_devices: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1


def role_of(plan: Plan, device: int) -> Role:
    """The role of ``device`` in ``plan``.

    Raises:
        ValueError: if the plan does not use ``device``.
    """
    for j, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            if device in stage.devices:
                return Role(
                    device=device,
                    pipeline=j,
                    stage=s,
                    tp_index=stage.devices.index(device),
                    spec=stage,
                    n_stages=pipe.n_stages,
                    prev_devices=pipe.stages[s - 1].devices if s > 0 else (),
                    next_devices=pipe.stages[s + 1].devices if s + 1 < pipe.n_stages else (),
                )
    raise ValueError(f"device {device} has no role in the plan")


@dataclass
class StageState:
    """Parameters of one stage (local shards under TP) and their AdamW optimizer."""

    names: list[str]
    params: dict[str, torch.Tensor]
    regions: dict[str, Region]
    optimizer: torch.optim.AdamW
    device: torch.device

    @classmethod
    def create(cls, model: ModelConfig, role: Role, *, seed: int, train: dict, device: torch.device) -> StageState:
        """Initialise the stage's parameters (this device's shards of the single-process init) and AdamW."""
        names = stage_param_names(model, role.spec.layers, first=role.first, last=role.last)
        full = init_params(model, seed, names=names)
        regions = {
            n: shard_region(tuple(t.shape), placements_for(n), role.tp_index, role.spec.tp) for n, t in full.items()
        }
        whole = {n: tuple((0, d) for d in t.shape) for n, t in full.items()}
        params = {
            n: t[local_slices(regions[n], whole[n])].contiguous().to(device).requires_grad_(True)
            for n, t in full.items()
        }
        optimizer = torch.optim.AdamW(
            [params[n] for n in names],
            lr=train["lr"],
            betas=(train["beta1"], train["beta2"]),
            eps=train["eps"],
            weight_decay=train["weight_decay"],
        )
        return cls(names=names, params=params, regions=regions, optimizer=optimizer, device=device)

    def grads(self, names: tuple[str, ...] | list[str]) -> list[torch.Tensor]:
        """Gradients of ``names`` (zeros where a parameter got none)."""
        out = []
        for n in names:
            p = self.params[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def shards(self) -> dict[str, tuple[Region, torch.Tensor]]:
        """A CPU copy of this device's parameter shards with the region each covers."""
        return {n: (self.regions[n], self.params[n].detach().to("cpu").clone()) for n in self.names}
