"""The recovery coordinator: a fault or a re-join → a decision → the next generation's plan and manifest.

It calls the decision centre (selector, planner, estimator) and the layout code
only; it touches no process and no store. The controller publishes what it returns.
Which devices a new plan may use is the selector's reading of the resident plan's
geometry: every live device, survivors of broken TP stages regrouped into units.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from chameleon.decision.config import PolicyConfig
from chameleon.decision.estimator import EVEN, Speeds, estimate_step
from chameleon.decision.measured import Measured
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import Profile
from chameleon.decision.selector import Decision, decide, decide_growth, decide_slow
from chameleon.layout.geometry import replica_groups, writers
from chameleon.layout.memory import relayout_memory
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import Manifest, relayout_held
from chameleon.layout.spec import Layout, Region, stage_holdings
from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of

LAYOUTS_KEPT = 4
MANIFESTS_KEPT = 3  # a recovery's, a growth readied ahead of its devices' return, the one deciding now


class NoRecovery(RuntimeError):
    """No candidate plan is feasible after a loss; the message says which region was lost and why."""


@dataclass(frozen=True)
class SavedState:
    """The newest complete checkpoint: its committed steps, when that step committed, and its root."""

    committed_steps: int
    committed_at: float
    root: Path


@dataclass
class _Moves:
    """The manifest from ``resident`` onto ``plan`` among ``survivors``, and the most bytes a device needs while it
    runs (once asked)."""

    resident: Plan
    survivors: frozenset[int]
    plan: Plan
    manifest: Manifest
    peak: float | None = None

    def of(self, resident: Plan, survivors: frozenset[int], plan: Plan) -> bool:
        return self.resident is resident and self.survivors == survivors and (self.plan is plan or self.plan == plan)


@dataclass(frozen=True)
class Transition:
    """A decided move to a new generation: its plan, where it resumes, and how state gets there."""

    decision: Decision
    plan: Plan
    members: tuple[int, ...]
    resume_step: int | None
    manifest: Manifest | None
    checkpoint: str | None

    @property
    def transition_s(self) -> float:
        return self.decision.chosen.transition if self.decision.chosen else 0.0

    @property
    def estimated_step_s(self) -> float:
        """The step time the selector scored the plan by: measured where its shape ran, else estimated."""
        return self.decision.chosen.t_step


class Coordinator:
    """Turns faults and re-joins into generations (see the module doc)."""

    def __init__(self, *, model: ModelConfig, profile: Profile, planner: Planner, policy: PolicyConfig,
                 checkpoint_steps: int = 0, domains: tuple[tuple[int, ...], ...] | None = None, tagless: bool = False):
        """``checkpoint_steps``: committed steps between checkpoints (0: none); ``domains``: devices that fail
        together (a node's), None when devices fail alone. Both price the next fault in each decision.
        ``tagless``: the workers' backend ignores tags (NCCL, HCCL); plans unsafe there are never chosen."""
        self.profile, self.planner, self.policy, self.tagless = profile, planner, policy, tagless
        self.checkpoint_steps, self.domains = checkpoint_steps, domains
        self.model, self.spec = model, spec_of(model)
        self.tp_sizes = model.tp_sizes  # what a re-formed TP group may be
        self.shapes = self.spec.param_shapes(model)
        self._estimated: tuple[Plan | None, float] = (None, 0.0)
        self._layouts: list[tuple[Plan, Layout]] = []
        self._holdings: list[tuple[Plan, dict[int, dict[str, Region]]]] = []
        self._moves: list[_Moves] = []  # the last few manifests built (:data:`MANIFESTS_KEPT`)

    def layout(self, plan: Plan) -> Layout:
        """``plan``'s layout (the last few plans' are kept)."""
        return _recent(self._layouts, plan, lambda: self.spec.layout(self.model, plan))

    def holdings(self, plan: Plan) -> dict[int, dict[str, Region]]:
        """Each device's regions under ``plan``, one dict per stage shape and TP index
        (:func:`~chameleon.layout.spec.stage_holdings`); the last few plans' are kept (the resident plan's serves
        every fault of its generation, a new plan's both its manifest and its replica groups)."""
        return _recent(self._holdings, plan, lambda: stage_holdings(
            plan, self.shapes, partial(self.spec.stage_param_names, self.model), rules=self.spec.tp_rules))

    def writers(self, plan: Plan) -> tuple[int, ...]:
        """The devices that write checkpoints under ``plan``."""
        return tuple(sorted(writers(self.layout(plan))))

    def replica_groups(self, plan: Plan) -> tuple[tuple[int, ...], ...]:
        """The devices under ``plan`` that hold the same regions (:func:`chameleon.layout.geometry.replica_groups`)."""
        return replica_groups(self.holdings(plan))

    def step_estimate(self, plan: Plan) -> float:
        """The estimator's step time of ``plan`` (the last plan's is kept: the resident plan is asked often)."""
        if self._estimated[0] is not plan:
            self._estimated = (plan, estimate_step(self.profile, plan, reroute_slots=self.policy.reroute_slots).t_step)
        return self._estimated[1]

    def recover(
        self, resident: Plan, *, alive: set[int], next_step: int, saved: SavedState | None, now: float,
        fault_times: list[float], elapsed_s: float, precomputed: Plan | None, fresh: str | None = None,
        measured: Measured = Measured(), speeds: Speeds = EVEN,
    ) -> Transition:
        """The generation after losing every device of ``resident`` not in ``alive``.

        ``fresh`` (not None) when no generation has started yet: survivors hold no state
        to move, so the new plan starts as the job does — from the checkpoint ``fresh``
        names, or from initialisation when it is empty.

        Raises:
            NoRecovery: no candidate is feasible (some region lost with no checkpoint, says which).
        """
        failed = set(resident.devices) - alive
        decision = decide(
            self.profile, resident, failed, policy=self.policy, planner=self._bounded(), precomputed=precomputed,
            fault_times=fault_times, elapsed_s=elapsed_s, idle=alive - set(resident.devices),
            measured=measured, tp_sizes=self.tp_sizes, speeds=speeds, tagless=self.tagless,
            relayout_peak=None if fresh is not None else self._peak(resident, alive),
            **self._fallback(resident, saved, now),
        )
        chosen = decision.chosen
        if chosen is None:
            raise NoRecovery(f"no recovery is possible after losing devices {sorted(failed)}: {decision.note}")
        if chosen.name == "checkpoint":
            return self._transition(decision, chosen.plan, alive, saved.committed_steps, None, str(saved.root))
        if fresh is not None:
            return self._transition(decision, chosen.plan, alive, next_step, None, fresh or None)
        return self._transition(decision, chosen.plan, alive, next_step, self._manifest(resident, alive, chosen.plan),
                                None)

    def _bounded(self) -> Planner:
        """The planner, its searches bounded by ``policy.decide_budget_s`` from now (anytime: the best found)."""
        return self.planner.within(self.policy.decide_budget_s)

    def _fallback(self, resident: Plan, saved: SavedState | None, now: float) -> dict:
        """What the selector needs to price the next fault: the checkpoint's age and interval, the fault domains."""
        interval = self.checkpoint_steps * self.step_estimate(resident) if self.checkpoint_steps else None
        return dict(checkpoint_age_s=now - saved.committed_at if saved else None, checkpoint_interval_s=interval,
                    domains=self.domains, in_process=True)

    def grow(self, resident: Plan, *, alive: set[int], joining: set[int], fault_times: list[float], elapsed_s: float,
             saved: SavedState | None = None, now: float = 0.0, measured: Measured = Measured(),
             precomputed: Plan | None = None) -> Transition | Decision:
        """The grown generation when taking ``joining`` devices in pays (Eq. 8), else the decision to stay
        (``precomputed``: the planner's best over every unit, placed, if searched ahead).

        Its ``resume_step`` is left to the caller: the step after the commit it switches at.
        """
        idle, members = joining | (alive - set(resident.devices)), alive | joining
        decision = decide_growth(self.profile, resident, idle, policy=self.policy, planner=self._bounded(),
                                 fault_times=fault_times, elapsed_s=elapsed_s, measured=measured,
                                 precomputed=precomputed, relayout_peak=self._peak(resident, members),
                                 **self._fallback(resident, saved, now))
        if decision.choice != "grow":
            return decision
        plan = decision.chosen.plan
        return self._transition(decision, plan, members, None, self._manifest(resident, members, plan), None)

    def reshape(self, resident: Plan, *, alive: set[int], speeds: Speeds, step_s: float, horizon_s: float,
                fault_times: list[float], elapsed_s: float, saved: SavedState | None = None,
                now: float = 0.0) -> Transition | Decision:
        """The generation that trains best with slow devices (``speeds``; empty: all back to speed), or the decision
        to tolerate them on ``resident`` (:func:`~chameleon.decision.selector.decide_slow`). ``step_s``: the step
        time measured on ``resident`` lately, at these speeds. Its ``resume_step`` is left to the caller."""
        estimate = estimate_step(self.profile, resident, reroute_slots=self.policy.reroute_slots, speeds=speeds).t_step
        decision = decide_slow(self.profile, resident, speeds, policy=self.policy, planner=self._bounded(),
                               horizon_s=horizon_s, scale=step_s / estimate if estimate > 0 else 1.0,
                               idle=alive - set(resident.devices), fault_times=fault_times, elapsed_s=elapsed_s,
                               tagless=self.tagless, relayout_peak=self._peak(resident, alive),
                               **self._fallback(resident, saved, now))
        if decision.choice == "tolerate":
            return decision
        plan = decision.chosen.plan
        return self._transition(decision, plan, alive, None, self._manifest(resident, alive, plan), None)

    def _manifest(self, resident: Plan, survivors: set[int], plan: Plan) -> Manifest:
        """The manifest from ``resident`` onto ``plan``, moving state among ``survivors`` (:meth:`_moved`)."""
        return self._moved(resident, frozenset(survivors), plan).manifest

    def _moved(self, resident: Plan, survivors: frozenset[int], plan: Plan) -> _Moves:
        """The manifest onto ``plan`` and its peak, built once: the selector's memory check and the transition share
        it, and a decision onto a plan equal to one of the last few finds it built (a growth readied before its
        devices came back: :class:`~chameleon.runtime.control.planning.GrowAhead`)."""
        for i, moves in enumerate(self._moves):
            if moves.of(resident, survivors, plan):
                self._moves.insert(0, self._moves.pop(i))
                return moves
        manifest = relayout_held(self.holdings(resident), self.holdings(plan), survivors=sorted(survivors))
        self._moves[:] = [_Moves(resident, survivors, plan, manifest), *self._moves[:MANIFESTS_KEPT - 1]]
        return self._moves[0]

    def _peak(self, resident: Plan, survivors: set[int]) -> Callable[[Plan], float]:
        """The most bytes a device needs while state moves from ``resident`` onto a plan among ``survivors``."""
        survivors, costs = frozenset(survivors), self.profile.memory_costs

        def peak(plan: Plan) -> float:
            moves = self._moved(resident, survivors, plan)
            if moves.peak is None:
                moves.peak = max(relayout_memory(costs, moves.manifest, resident, plan).values(), default=0.0)
            return moves.peak
        return peak

    def _transition(self, decision, plan, members, resume_step, manifest, checkpoint) -> Transition:
        return Transition(decision, plan, tuple(sorted(members)), resume_step, manifest, checkpoint)


def _recent(kept: list[tuple[Plan, object]], plan: Plan, build):
    """What ``build()`` gives for ``plan``, kept in ``kept`` with the last few plans' (:data:`LAYOUTS_KEPT`)."""
    for known, value in kept:
        if known is plan:
            return value
    kept[:] = [(plan, build()), *kept[:LAYOUTS_KEPT - 1]]
    return kept[0][1]

