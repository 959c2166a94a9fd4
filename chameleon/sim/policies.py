"""How a simulated policy answers faults and re-joins; Chameleon's own policies.

A policy is an object with a first plan and three handlers, :meth:`Policy.on_fault`,
:meth:`Policy.on_rejoin` and :meth:`Policy.on_slow`, each returning a :class:`Response` (the plan to run
after a pause, the pause by part of the time breakdown). Plans, step times and transitions come from the
real planner and estimator through :class:`Planning`. Chameleon's policies are the selector
(:func:`chameleon.decision.selector.decide`) under different :class:`PolicyConfig`:

- ``chameleon``: Eq. 8 and the next fault's cost over every candidate, ``D``
  estimated online from the fault history; slow devices, once its detector has
  seen ``ft.slow_window`` steps at their new speed, by
  :func:`~chameleon.decision.selector.decide_slow` over ``ft.slow_expected_s``.
- ``oracle``: the same with the true time to the next fault and the true end of
  the slowness (hindsight).
- ``dynamic`` / ``reroute``: Chameleon forced to re-plan / to reroute (Eq. 12/13).
- ``tolerate``: Chameleon on faults, slow devices ignored (``ft.slow=off``).

Every policy but ``chameleon`` and ``oracle`` trains on at the slow devices' pace
(the engine stretches its step by the estimator's figure at their speeds);
``failstop`` (:mod:`chameleon.sim.baselines.failstop`) restarts without them.

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
from chameleon.decision.selector import Candidate, decide, decide_growth, decide_slow
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import Pipeline, Plan, PlanError, Stage

Units = list[tuple[int, ...]]


@dataclass(frozen=True)
class Response:
    """A policy's answer: the plan to run (None: the job cannot go on) after ``pause_s``, at ``t_step`` with every
    device at full speed; ``parts`` splits the pause by :data:`~chameleon.report.breakdown.TIME_PARTS` (None: all
    of it ``restore``)."""

    plan: Plan | None
    pause_s: float
    t_step: float
    choice: str
    d_s: float = math.nan
    rollback: bool = False
    parts: dict[str, float] | None = None

    @property
    def pause_parts(self) -> dict[str, float]:
        return self.parts if self.parts is not None else {"restore": self.pause_s}


def candidate_response(chosen: Candidate, d_s: float, *, t_step: float) -> Response:
    """Move to the selector's ``chosen`` candidate: its plan search is ``decision``, the rest of its transition
    ``restore``; a checkpoint reload rolls back (the engine counts the progress it discards)."""
    parts = {"decision": chosen.transition_parts.get("search", 0.0),
             "restore": sum(s for k, s in chosen.transition_parts.items() if k not in ("search", "lost_progress"))}
    return Response(chosen.plan, sum(parts.values()), t_step, chosen.name, d_s, rollback=chosen.name == "checkpoint",
                    parts=parts)


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


@dataclass(frozen=True)
class SpeedChange:
    """The devices a policy's detector finds slow at ``now_s`` (``speeds``: device → time factor, every device
    noticed slow, dead ones included; empty: all back to speed); ``remaining_s`` is how long the longest of these
    episodes truly goes on (the oracle's hindsight)."""

    now_s: float
    speeds: dict[int, float]
    dead: frozenset[int]
    fault_times: tuple[float, ...]
    next_fault_s: float
    remaining_s: float
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
        self._slowdowns: dict[tuple[Plan, tuple[tuple[int, float], ...]], float] = {}

    def t_step(self, plan: Plan) -> float:
        """Estimated step time, cached per plan."""
        if plan not in self._steps:
            self._steps[plan] = est.estimate_step(self.profile, plan).t_step
        return self._steps[plan]

    def slowdown(self, plan: Plan, speeds: est.Speeds) -> float:
        """How many times longer ``plan``'s estimated step is at ``speeds`` than at full speed (1: none of its devices
        is slow), cached."""
        key = (plan, tuple(sorted((d, f) for d, f in speeds.items() if d in plan.device_set)))
        if not key[1]:
            return 1.0
        if key not in self._slowdowns:
            self._slowdowns[key] = est.estimate_step(self.profile, plan, speeds=dict(key[1])).t_step / self.t_step(plan)
        return self._slowdowns[key]

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
                        Pipeline(stages=tuple(Stage(devices=(), layers=b, recompute=self.profile.recompute)
                                              for b in split.bounds()), micro_batches=n_micro // dp)
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
        """This policy's step time on ``plan``, every device at full speed."""
        return self.planning.t_step(plan)

    def slowdown(self, plan: Plan, speeds: est.Speeds) -> float:
        """How many times longer this policy's step on ``plan`` takes at ``speeds`` (its planning's estimate)."""
        return self.planning.slowdown(plan, speeds)

    @property
    def checkpoint_mtbf_s(self) -> float:
        """The mean time between the restarts its Young/Daly checkpoint interval is set for: the trace's faults."""
        return self.setup.mtbf_s

    def on_fault(self, plan: Plan, fault: Fault) -> Response:
        raise NotImplementedError

    def on_rejoin(self, plan: Plan, rejoin: Rejoin) -> Response | None:
        """Use returned devices; None keeps the plan (the default: returned devices idle)."""
        return None

    def slow_delay_s(self, t_step: float, *, onset: bool) -> float | None:
        """Seconds from a device's change of speed (``onset``: it slowed down) until this policy notices it, at a step
        of ``t_step``; None: it never does (the default: it trains on at whatever pace the slowest device sets)."""
        return None

    def on_slow(self, plan: Plan, change: SpeedChange) -> Response | None:
        """Answer the slow devices it noticed; None keeps the plan."""
        return None


class ChameleonPolicy(Policy):
    """Chameleon's selector: Eq. 8 (``chameleon``, ``oracle``, ``tolerate``) or one strategy forced (``dynamic``,
    ``reroute``); slow devices decided by Eq. 8 too (``chameleon``, ``oracle``)."""

    SELECTOR = {"chameleon": "chameleon", "oracle": "chameleon", "dynamic": "dynamic", "reroute": "reroute",
                "tolerate": "chameleon"}
    SLOW_AWARE = ("chameleon", "oracle")

    checkpoints = "async"

    def __init__(self, name: str, setup):
        super().__init__(name, setup)
        self.slow: set[int] = set()  # devices its detector last found slow: a re-plan after a fault leaves them idle

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
            domains=self._domains(fault.dead), in_process=True, idle=idle, tp_sizes=self.setup.tp_sizes,
        )
        chosen = decision.chosen
        if chosen is None:
            return Response(None, 0.0, math.inf, "halt", decision.d_s)
        return candidate_response(chosen, decision.d_s, t_step=chosen.t_step)

    def slow_delay_s(self, t_step: float, *, onset: bool) -> float | None:
        """The runtime's detector: ``ft.slow_window`` steps at the new speed (``ft.slow=off``, or a policy other than
        ``chameleon`` and ``oracle``: never)."""
        if self.name not in self.SLOW_AWARE or self.setup.ft.slow != "on":
            return None
        return self.setup.ft.slow_window * t_step

    def on_slow(self, plan: Plan, change: SpeedChange) -> Response:
        """Tolerate, rebalance, relayer, re-plan or evict by Eq. 8 over the slowness's expected remaining
        ``ft.slow_expected_s`` (the oracle: its true remaining time); all back to speed, decided again (growing back)."""
        self.slow = set(change.speeds)
        live = {d: f for d, f in change.speeds.items() if d not in change.dead}
        horizon = change.remaining_s if self.name == "oracle" else self.setup.ft.slow_expected_s
        decision = decide_slow(
            self.planning.profile, plan, live, policy=self._config(change.next_fault_s), planner=self.planning.planner,
            horizon_s=horizon, idle=self._idle(plan, change.dead) | (set(live) - plan.device_set),
            fault_times=list(change.fault_times), elapsed_s=change.now_s, checkpoint_age_s=change.checkpoint_age_s,
            checkpoint_interval_s=change.checkpoint_interval_s, domains=self._domains(change.dead), in_process=True,
        )
        chosen = decision.chosen
        return candidate_response(chosen, decision.d_s, t_step=self.planning.t_step(chosen.plan))

    def _idle(self, plan: Plan, dead) -> set[int]:
        """Live devices ``plan`` leaves idle, but for those found slow."""
        return set(range(self.setup.n_devices)) - set(dead) - set(plan.devices) - self.slow

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
                st = replace(st, devices=unit)
            stages.append(st)
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=p.micro_batches))
    if not filled:
        return None, spares
    reroutes = tuple(r for r in plan.reroutes if (r.pipeline, r.stage) not in filled)
    return Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=tuple(pipelines), reroutes=reroutes), left


def _stage_tp(plan: Plan, stage: int) -> int:
    """TP width of stage ``stage`` in the pipelines that still have it."""
    return max(p.stages[stage].tp for p in plan.pipelines if stage < p.n_stages)
