"""Step times measured in this run, which the selector trusts over the estimator's.

The estimator's figures carry its error, large where worker processes share a
host's cores (docs/decision.md); a step time the runtime measured does not. A
candidate whose plan has the shape of one that ran is scored by that plan's
median step time; any other by its estimate scaled by measured ÷ estimated on
the plan running now, so measured and modelled figures compare on one scale.
The plans that ran are also re-plan options where their devices are all
available again, so a job regaining a node can go back to the layout it
measured there.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

from chameleon.layout.plan import Plan

MIN_STEPS = 3  # steady steps a plan must have run before its median stands in for the estimate


def plan_shape(plan: Plan) -> tuple:
    """What a plan's step time depends on, device ids aside: stages' layers, TP widths and recomputation,
    micro-batches, reroutes.

    Pipelines are compared as a set unless reroutes name them by position.
    """
    pipes = tuple((tuple((s.layers, s.tp, s.recompute) for s in p.stages), p.micro_batches) for p in plan.pipelines)
    return plan.micro_batch_size, pipes if plan.reroutes else tuple(sorted(pipes)), plan.reroutes


@dataclass(frozen=True)
class Measured:
    """Plans that ran in this run with their median step time, and the estimator's scale on this host now."""

    runs: tuple[tuple[Plan, float], ...] = ()
    scale: float = 1.0

    @classmethod
    def of(cls, ran: Iterable[tuple[Plan, list[float]]], resident: Plan, estimate_s: float) -> Measured:
        """From each plan's steady step times; ``estimate_s``: the estimator's step time for ``resident``."""
        runs = tuple((plan, statistics.median(times)) for plan, times in ran if len(times) >= MIN_STEPS)
        shape = plan_shape(resident)
        now = next((t for plan, t in runs if plan_shape(plan) == shape), None)
        return cls(runs, now / estimate_s if now and estimate_s > 0 else 1.0)

    @cached_property
    def _by_shape(self) -> dict[tuple, float]:
        return {plan_shape(plan): t for plan, t in self.runs}

    def step_s(self, plan: Plan, estimate_s: float) -> float:
        """``plan``'s measured step time if its shape ran, else ``estimate_s`` on the measured scale."""
        return self._by_shape.get(plan_shape(plan), estimate_s * self.scale)

    def ran_on(self, devices: set[int]) -> Plan | None:
        """The fastest plan that ran on exactly ``devices`` (reroutes left out), if any: devices coming back to it
        need no search."""
        exact = [(t, i) for i, (plan, t) in enumerate(self.runs) if not plan.reroutes and set(plan.devices) == devices]
        return self.runs[min(exact)[1]][0] if exact else None

    def plans_on(self, devices: set[int]) -> list[Plan]:
        """Plans that ran on devices all among ``devices``, reroutes left out (they are a fault's stopgap)."""
        return [plan for plan, _ in self.runs if not plan.reroutes and set(plan.devices) <= devices]
