"""How each simulated policy answers a fault or a re-join, through the real decision centre.

Every policy but ``torchft`` is the selector (:func:`chameleon.decision.selector.decide`)
with a different :class:`PolicyConfig`; the plan, its step time and its transition
come from the planner and estimator. What differs:

- ``chameleon``: Eq. 8 over every candidate, ``D`` estimated online from the fault history.
- ``oracle``: Eq. 8 with the true time to the next fault (hindsight).
- ``reroute`` (ReCycle-like), ``dynamic`` (Oobleck-like, survivors placed by the
  min-bytes assignment), ``dynamic_naive`` (the same plan, survivors taken in plan
  order, as Oobleck's broadcast of missing layers does).
- ``redundant`` (Bamboo-like): every stage also runs its successor's forward, so
  its profile's forward time is ``(2 − redundant_hidden)×``, before and after faults;
  a fault is a neighbour takeover whose state is already there (no migration).
- ``checkpoint``: restart on the survivors from the newest checkpoint; the engine
  writes one every Young/Daly interval ``sqrt(2·δ·MTBF)``.
- ``torchft``: the replica (pipeline) holding a failed device drops out and the
  global batch shrinks; it heals when its devices are back.

Plans for ``n`` survivors are searched once per ``n`` (the planner's precompute)
and only re-placed afterwards, so the search costs no simulated time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from chameleon.decision import estimator as est
from chameleon.decision.config import PolicyConfig
from chameleon.decision.planner import Planner, place, stage_units
from chameleon.decision.profiler import Profile
from chameleon.decision.selector import decide, estimate_d, score
from chameleon.layout.plan import Pipeline, Plan, PlanError, Stage

SELECTOR_NAME = {
    "chameleon": "chameleon", "oracle": "chameleon", "reroute": "reroute", "dynamic": "dynamic",
    "dynamic_naive": "dynamic", "redundant": "redundant", "checkpoint": "checkpoint",
}


@dataclass(frozen=True)
class Response:
    """A policy's answer: the plan to run (None: the job cannot go on) after ``pause_s``."""

    plan: Plan | None
    pause_s: float
    t_step: float
    choice: str
    d_s: float = math.nan
    rollback: bool = False


class Planning:
    """One profile's planner, with plan shapes cached per survivor count.

    Args:
        profile: Costs the planner and estimator use.
        policy: Search ranges (``dp_degrees``, ``pp_lengths``).
    """

    def __init__(self, profile: Profile, policy: PolicyConfig):
        self.profile = profile
        self.planner = Planner(profile, dp_degrees=tuple(policy.dp_degrees), pp_lengths=tuple(policy.pp_lengths))
        self._shapes: dict[tuple[int, int, int], Plan | None] = {}
        self._steps: dict[Plan, float] = {}

    def t_step(self, plan: Plan) -> float:
        """Estimated step time, cached per plan."""
        if plan not in self._steps:
            self._steps[plan] = est.estimate_step(self.profile, plan).t_step
        return self._steps[plan]

    def replan(self, units: list[tuple[int, ...]], previous: Plan, *, hungarian: bool) -> Plan | None:
        """The best plan on ``units``, placed by min-bytes assignment or in ``units`` order; None if none fits."""
        key = (len(units), previous.n_micro_batches, previous.micro_batch_size)
        if key not in self._shapes:
            try:
                self._shapes[key] = self.planner.choose(units, n_micro=key[1], micro_batch_size=key[2])
            except PlanError:
                self._shapes[key] = None
        shape = self._shapes[key]
        if shape is None:
            return None
        it = iter(units)
        pipelines = tuple(
            Pipeline(stages=tuple(Stage(devices=next(it), layers=st.layers) for st in p.stages), micro_batches=p.micro_batches)
            for p in shape.pipelines
        )
        filled = Plan(n_layers=shape.n_layers, micro_batch_size=shape.micro_batch_size, pipelines=pipelines)
        return place(filled, previous, self.profile) if hungarian else filled


def redundant_profile(profile: Profile, *, hidden: float) -> Profile:
    """Bamboo's eager redundancy: each stage also runs its successor's forward, ``hidden`` of it in bubbles."""
    return replace(profile, layer_fwd_s=profile.layer_fwd_s * (2.0 - hidden))


def on_fault(
    name: str, planning: Planning, plan: Plan, failed: set[int], *, policy: PolicyConfig, now_s: float,
    fault_times: list[float], next_fault_s: float, checkpoint_age_s: float | None,
) -> Response:
    """The response of policy ``name`` to ``failed`` devices of ``plan`` at ``now_s``."""
    if name == "torchft":
        kept = tuple(p for p in plan.pipelines if not failed & set(p.devices))
        if not kept:
            return Response(None, 0.0, math.inf, "halt")
        new = Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=kept)
        return Response(new, est.rebuild_time(planning.profile, new), planning.t_step(new), "drop_replica")
    cfg = replace(policy, name=SELECTOR_NAME[name], fixed_d_s=next_fault_s if name == "oracle" else policy.fixed_d_s)
    units = stage_units(plan, failed)
    pre = planning.replan(units, plan, hungarian=name != "dynamic_naive") if units else None
    decision = decide(
        planning.profile, plan, failed, policy=cfg, planner=planning.planner, fault_times=fault_times,
        elapsed_s=now_s, checkpoint_age_s=checkpoint_age_s if name == "checkpoint" else None, precomputed=pre,
    )
    chosen = decision.chosen
    if chosen is None:
        return Response(None, 0.0, math.inf, "halt", decision.d_s)
    parts = dict(chosen.transition_parts)
    if name == "redundant" and chosen.name == "redundant":
        parts.pop("migrate", None)  # the shadow copy is already on the neighbour
    rollback = chosen.name == "checkpoint"
    if rollback:
        parts.pop("lost_progress")  # the engine rolls the samples back instead
    return Response(chosen.plan, sum(parts.values()), chosen.t_step, chosen.name, decision.d_s, rollback)


def on_rejoin(
    name: str, planning: Planning, plan: Plan, spares: list[tuple[int, ...]], *, policy: PolicyConfig, now_s: float,
    fault_times: list[float], next_fault_s: float,
) -> tuple[Response, list[tuple[int, ...]]] | None:
    """Use returned devices ``spares``: refill rerouted stages, else re-plan when Eq. 8 says it pays.

    Returns:
        The response and the spares still unused, or None to keep the plan as it is.
    """
    new, left = _refill(plan, spares)
    if new is None and name not in ("reroute", "torchft"):
        grown = planning.replan(stage_units(plan) + spares, plan, hungarian=name != "dynamic_naive")
        if grown is None:
            return None
        d_s = next_fault_s if name == "oracle" else estimate_d(policy, fault_times=fault_times, elapsed_s=now_s)[0]
        pause = est.migration_time(planning.profile, plan, grown)[0] + est.rebuild_time(planning.profile, grown)
        gain = score(global_batch=grown.global_batch, t_step=planning.t_step(grown), transition=pause, d_s=d_s)
        if d_s <= pause or gain <= plan.global_batch / planning.t_step(plan):
            return None
        new, left = grown, []
    if new is None:
        return None
    pause = est.migration_time(planning.profile, plan, new)[0] + est.rebuild_time(planning.profile, new)
    return Response(new, pause, planning.t_step(new), "rejoin"), left


def _refill(plan: Plan, spares: list[tuple[int, ...]]) -> tuple[Plan | None, list[tuple[int, ...]]]:
    """Put spare units on device-less (rerouted) stages of the same TP width; None if none was filled."""
    left = list(spares)
    pipelines, filled = [], set()
    for j, p in enumerate(plan.pipelines):
        stages = []
        for s, st in enumerate(p.stages):
            unit = next((u for u in left if not st.devices and len(u) == _tp(plan, s)), None)
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


def _tp(plan: Plan, stage: int) -> int:
    """TP width of stage ``stage`` in the pipelines that still have it."""
    return max(p.stages[stage].tp for p in plan.pipelines if stage < p.n_stages)


def torchft_heal(planning: Planning, plan: Plan, dropped: list[Pipeline], dead: set[int]) -> tuple[Response | None, list[Pipeline]]:
    """Bring back dropped replicas whose devices are all alive again (state fetched from a live replica)."""
    back = [p for p in dropped if not dead & set(p.devices)]
    if not back:
        return None, dropped
    new = Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=plan.pipelines + tuple(back))
    pause = est.migration_time(planning.profile, plan, new)[0] + est.rebuild_time(planning.profile, new)
    return Response(new, pause, planning.t_step(new), "heal"), [p for p in dropped if p not in back]
