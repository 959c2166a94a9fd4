"""How a simulated policy answers faults and re-joins; Chameleon's own policies.

A policy is an object with a first plan and two handlers, :meth:`Policy.on_fault`
and :meth:`Policy.on_rejoin`, each returning a :class:`Response` (the plan to run
after a pause). Plans, step times and transitions come from the real planner and
estimator through :class:`Planning`. Chameleon's policies are the selector
(:func:`chameleon.decision.selector.decide`) under different :class:`PolicyConfig`:

- ``chameleon``: Eq. 8 and the next fault's cost over every candidate, ``D``
  estimated online from the fault history.
- ``oracle``: the same with the true time to the next fault (hindsight).
- ``dynamic`` / ``reroute``: Chameleon forced to re-plan / to reroute (Eq. 12/13).

Like the runtime, they write asynchronous checkpoints (the engine's Young/Daly
writes, training on while they land) and fall back on the newest one when a
fault leaves some region of the state with no holder; the selector knows its age
and interval. Who holds what, and which live devices form units, is the plan's
geometry (:mod:`chameleon.layout.geometry`), as in the runtime.
The baselines from other papers live in :mod:`chameleon.sim.baselines`.
Plans for ``n`` survivors are searched once per ``n`` (the planner's precompute)
and only re-placed afterwards, so the search costs no simulated time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from chameleon.decision import estimator as est
from chameleon.decision.config import PolicyConfig
from chameleon.decision.planner import Planner, place, refill
from chameleon.decision.profiler import Profile
from chameleon.decision.selector import decide, decide_growth
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import Pipeline, Plan, PlanError, Stage

Units = list[tuple[int, ...]]


@dataclass(frozen=True)
class Response:
    """A policy's answer: the plan to run (None: the job cannot go on) after ``pause_s``."""

    plan: Plan | None
    pause_s: float
    t_step: float
    choice: str
    d_s: float = math.nan
    rollback: bool = False


@dataclass(frozen=True)
class Fault:
    """Devices ``failed`` (all in the running plan) at ``now_s``; ``dead`` are all devices down now."""

    now_s: float
    failed: frozenset[int]
    dead: frozenset[int]
    fault_times: tuple[float, ...]  # earlier faults
    next_fault_s: float  # true time to the next fault (the oracle's hindsight)
    checkpoint_age_s: float | None = None
    checkpoint_interval_s: float | None = None


@dataclass(frozen=True)
class Rejoin:
    """Devices ``back`` after repair at ``now_s``; ``dead`` are the devices still down."""

    now_s: float
    back: frozenset[int]
    dead: frozenset[int]
    fault_times: tuple[float, ...]
    next_fault_s: float
    checkpoint_age_s: float | None = None
    checkpoint_interval_s: float | None = None


class Planning:
    """One profile's planner and estimator, with plan shapes cached per unit count.

    Args:
        profile: Costs the planner and estimator use.
        policy: Search ranges (``dp_degrees``, ``pp_lengths``).
    """

    def __init__(self, profile: Profile, policy: PolicyConfig):
        self.profile = profile
        self.planner = Planner(profile, dp_degrees=tuple(policy.dp_degrees), pp_lengths=tuple(policy.pp_lengths))
        self._shapes: dict[tuple[int, int, int], Plan | None] = {}
        self._even: dict[tuple[int, int, int], Plan | None] = {}
        self._steps: dict[Plan, float] = {}

    def t_step(self, plan: Plan) -> float:
        """Estimated step time, cached per plan."""
        if plan not in self._steps:
            self._steps[plan] = est.estimate_step(self.profile, plan).t_step
        return self._steps[plan]

    def best(self, units: Units, *, n_micro: int, micro_batch_size: int, previous: Plan | None = None) -> Plan | None:
        """The planner's best plan on every unit of ``units``, placed to move the least state from ``previous``.

        None when no plan fits.
        """
        key = (len(units), n_micro, micro_batch_size)
        if not units:
            return None
        if key not in self._shapes:
            try:
                self._shapes[key] = self.planner.choose(units, n_micro=n_micro, micro_batch_size=micro_batch_size)
            except PlanError:
                self._shapes[key] = None
        shape = self._shapes[key]
        if shape is None:
            return None
        filled = refill(shape, units)
        return place(filled, previous, self.profile) if previous is not None else filled

    def best_even(self, units: Units, *, n_micro: int, micro_batch_size: int) -> Plan | None:
        """The fastest even plan (``dp`` equal pipelines, ``dp`` dividing ``n_micro``) on at most ``len(units)`` units.

        What a Megatron-style framework runs: every pipeline has the same layer
        split (the planner's fastest for its length) and the same micro-batches;
        units beyond ``dp · pp`` idle. None when nothing fits.
        """
        key = (len(units), n_micro, micro_batch_size)
        if key not in self._even:
            shapes = []
            for pp, split in self.planner.splits.items():
                for dp in range(1, min(len(units) // pp, n_micro) + 1):
                    if n_micro % dp or (split.max_micro is not None and n_micro // dp > split.max_micro):
                        continue
                    pipes = tuple(
                        Pipeline(stages=tuple(Stage(devices=(), layers=b) for b in split.bounds()), micro_batches=n_micro // dp)
                        for _ in range(dp)
                    )
                    shapes.append(refill(Plan(n_layers=self.profile.n_layers, micro_batch_size=micro_batch_size, pipelines=pipes), units))
            fitting = [p for p in shapes if max(est.memory_per_device(self.profile, p).values()) <= self.profile.memory_bytes]
            self._even[key] = min(fitting, key=lambda p: (self.t_step(p), len(p.devices)), default=None)
        shape = self._even[key]
        return None if shape is None else refill(shape, units)


def require_equal_pipelines(plan: Plan, name: str) -> Plan:
    """``plan`` when its pipelines are alike (the same stages, layers and TP widths).

    Raises:
        ValueError: Naming policy ``name``, which replicates one pipeline, and the fix.
    """
    if len({tuple((st.layers, st.tp) for st in p.stages) for p in plan.pipelines}) > 1:
        raise ValueError(f"sim.policies: {name} needs equal pipelines but the starting plan's differ: set sim.initial=planner, "
                         f"give parallel.dp/pp instead of parallel.pipelines, or drop {name}")
    return plan


def rebuild_response(planning: Planning, old: Plan, new: Plan | None, choice: str, *, extra_s: float = 0.0) -> Response:
    """Move to ``new``: state migration + group rebuild (+ ``extra_s``); a halt when ``new`` is None."""
    if new is None:
        return Response(None, 0.0, math.inf, "halt")
    pause = est.migration_time(planning.profile, old, new)[0] + est.rebuild_time(planning.profile, new) + extra_s
    return Response(new, pause, planning.t_step(new), choice)


class Policy:
    """A recovery policy on one simulated run; subclasses keep whatever state they need across events.

    Args:
        name: The policy's name in ``sim.policies``.
        setup: The run's planning, plans and options (:class:`chameleon.sim.engine.Setup`).
    """

    checkpoints: str | None = None  # the engine writes Young/Daly checkpoints for this policy: "blocking" or "async"

    def __init__(self, name: str, setup):
        self.name = name
        self.setup = setup
        self.planning: Planning = setup.planning

    def start(self) -> Plan:
        """The failure-free plan this policy trains on: the setup's starting plan, every policy's."""
        return self.setup.plan

    def t_step(self, plan: Plan) -> float:
        """This policy's step time on ``plan``."""
        return self.planning.t_step(plan)

    def on_fault(self, plan: Plan, fault: Fault) -> Response:
        raise NotImplementedError

    def on_rejoin(self, plan: Plan, rejoin: Rejoin) -> Response | None:
        """Use returned devices; None keeps the plan (the default: returned devices idle)."""
        return None


class ChameleonPolicy(Policy):
    """Chameleon's selector: Eq. 8 (``chameleon``, ``oracle``) or one strategy forced (``dynamic``, ``reroute``)."""

    SELECTOR = {"chameleon": "chameleon", "oracle": "chameleon", "dynamic": "dynamic", "reroute": "reroute"}

    checkpoints = "async"

    def _config(self, next_fault_s: float) -> PolicyConfig:
        policy = self.setup.policy
        return replace(policy, name=self.SELECTOR[self.name], fixed_d_s=next_fault_s if self.name == "oracle" else policy.fixed_d_s)

    def on_fault(self, plan: Plan, fault: Fault) -> Response:
        failed, idle = set(fault.failed), self._idle(plan, fault.dead)
        units = geometry_of(plan).units((set(plan.devices) - failed) | idle)
        pre = self.planning.best(units, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size, previous=plan) if units else None
        decision = decide(
            self.planning.profile, plan, failed, policy=self._config(fault.next_fault_s), planner=self.planning.planner,
            fault_times=list(fault.fault_times), elapsed_s=fault.now_s, precomputed=pre,
            checkpoint_age_s=fault.checkpoint_age_s, checkpoint_interval_s=fault.checkpoint_interval_s,
            domains=self._domains(fault.dead), in_process=True, idle=idle,
        )
        chosen = decision.chosen
        if chosen is None:
            return Response(None, 0.0, math.inf, "halt", decision.d_s)
        reload = chosen.name == "checkpoint"  # the engine discards the rolled-back progress itself
        pause = chosen.transition - chosen.transition_parts.get("lost_progress", 0.0)
        return Response(chosen.plan, pause, chosen.t_step, chosen.name, decision.d_s, rollback=reload)

    def _idle(self, plan: Plan, dead) -> set[int]:
        """Live devices ``plan`` leaves idle."""
        return set(range(self.setup.n_devices)) - set(dead) - set(plan.devices)

    def _domains(self, dead) -> tuple[tuple[int, ...], ...] | None:
        """The live devices of each fault domain of the setup (None: every device alone)."""
        if self.setup.domains is None:
            return None
        return tuple(g for g in (tuple(d for d in group if d not in dead) for group in self.setup.domains) if g)

    def on_rejoin(self, plan: Plan, rejoin: Rejoin) -> Response | None:
        """Refill rerouted stages with returned units, else grow onto all of them when the selector says it pays."""
        idle, geometry = self._idle(plan, rejoin.dead), geometry_of(plan)
        new = refill_rerouted(plan, geometry.units(idle))[0]
        if new is None and self.name != "reroute":
            policy = replace(self._config(rejoin.next_fault_s), name="chameleon")  # forced ones grow only when it pays too
            decision = decide_growth(
                self.planning.profile, plan, idle, policy=policy, planner=self.planning.planner,
                fault_times=list(rejoin.fault_times), elapsed_s=rejoin.now_s, checkpoint_age_s=rejoin.checkpoint_age_s,
                checkpoint_interval_s=rejoin.checkpoint_interval_s, domains=self._domains(rejoin.dead), in_process=True,
                precomputed=self.planning.best(geometry.units(set(plan.devices) | idle), n_micro=plan.n_micro_batches,
                                               micro_batch_size=plan.micro_batch_size, previous=plan),
            )
            new = decision.chosen.plan if decision.choice == "grow" else None
        return None if new is None else rebuild_response(self.planning, plan, new, "rejoin")


def refill_rerouted(plan: Plan, spares: Units) -> tuple[Plan | None, Units]:
    """Put spare units on device-less (rerouted) stages of the same TP width; None if none was filled."""
    left = list(spares)
    pipelines, filled = [], set()
    for j, p in enumerate(plan.pipelines):
        stages = []
        for s, st in enumerate(p.stages):
            unit = next((u for u in left if not st.devices and len(u) == _stage_tp(plan, s)), None)
            if unit is not None:
                left.remove(unit)
                filled.add((j, s))
                st = Stage(devices=unit, layers=st.layers)
            stages.append(st)
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=p.micro_batches))
    if not filled:
        return None, spares
    reroutes = tuple(r for r in plan.reroutes if (r.pipeline, r.stage) not in filled)
    return Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=tuple(pipelines), reroutes=reroutes), left


def _stage_tp(plan: Plan, stage: int) -> int:
    """TP width of stage ``stage`` in the pipelines that still have it."""
    return max(p.stages[stage].tp for p in plan.pipelines if stage < p.n_stages)
