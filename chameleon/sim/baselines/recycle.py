"""ReCycle (SOSP'24, arXiv 2405.14009): rerouting whose extra work fills the pipeline bubbles.

ReCycle reroutes a failed stage's micro-batches to the same stage of peer
pipelines ("functional redundancy"), splits each backward into the input
gradient (on the critical path) and the weight gradient (deferred into bubbles:
Decoupled BackProp), and lets each stage step its optimizer as soon as its own
gradients are reduced (Staggered Optimizer); its planner precomputes the
adapted schedules with an MILP. Modelled:

- Layout: the starting plan, whose pipelines must be alike (same-stage peers hold the same layers).
- After a fault: the rerouted plan (:func:`chameleon.decision.selector.reroute_plan`),
  micro-batch ``i`` of the lost stage on host ``i mod |hosts|``, feasible while
  every lost stage has a live peer and the hosts' extra activations fit
  (Eq. 14 per served pipeline).
- Step time: ``max(t_1F1B, max_d (work_d + sync_d + opt_d))`` — the original
  plan's 1F1B step (the abstract's best case: "minimize or even eliminate
  throughput degradation") or, when the extra work does not fit in the bubbles,
  the busiest device's forward+backward over all micro-batches it runs plus its
  own stage's gradient all-reduce and optimizer step. This is a lower bound on
  any schedule's step (each device must do its work), so it is ReCycle at its
  best: every bubble filled, every other stage's sync hidden by staggering.
- Pause: the communicator rebuild (schedules are precomputed, no search).
- Re-joins refill rerouted stages (migration of the stage's state + rebuild); with no
  rerouted stage left (after a restart), a restart onto the fastest even plan of the
  live devices when that is faster.
- When rerouting is infeasible, the job restarts on the fastest even plan of the
  live devices with state from surviving replicas: ``cluster.restart_s`` +
  migration + rebuild (an assumption: the paper does not say).

Left out: the activation transfers of rerouted micro-batches between pipelines
(folded into the stage's point-to-point cost) and the memory of deferred weight
gradients.
"""

from __future__ import annotations

from collections import Counter

from chameleon.decision import estimator as est
from chameleon.decision.selector import reroute_plan
from chameleon.decision.profiler import Profile
from chameleon.layout.geometry import geometry_of, tp_units
from chameleon.layout.plan import Plan, PlanError
from chameleon.sim.policies import (
    Fault, Planning, Policy, Rejoin, Response, rebuild_response, refill_rerouted, require_equal_pipelines,
)


def device_work(profile: Profile, plan: Plan) -> dict[tuple[int, int], float]:
    """Seconds of forward + backward each live stage ``(pipeline, stage)`` runs per step, hosted micro-batches included."""
    hosted: Counter[tuple[int, int]] = Counter()
    for r in plan.reroutes:
        for i in range(plan.pipelines[r.pipeline].micro_batches):
            hosted[(r.hosts[i % len(r.hosts)], r.stage)] += 1
    work = {}
    for j, p in enumerate(plan.pipelines):
        for s, st in enumerate(p.stages):
            if st.devices:
                fwd, bwd = est.stage_cost(profile, st.n_layers, first=s == 0, last=s == p.n_stages - 1)
                work[(j, s)] = (p.micro_batches + hosted[(j, s)]) * (fwd + bwd)
    return work


def bound_step(profile: Profile, plan: Plan) -> float:
    """The busiest stage's work + its own stage's all-reduce (over the live replicas) + optimizer step."""
    work = device_work(profile, plan)
    holders = Counter(s for _, s in work)
    out = 0.0
    for (j, s), seconds in work.items():
        p = plan.pipelines[j]
        params = est.device_params(profile, p.stages[s].n_layers, first=s == 0, last=s == p.n_stages - 1)
        sync = est.allreduce_time(profile, holders[s], params)
        out = max(out, seconds + sync + params * profile.optimizer_s_per_param)
    return out


def recycle_step(planning: Planning, plan: Plan, healthy: Plan) -> float:
    """ReCycle's step on rerouted ``plan``: at best ``healthy``'s 1F1B step, at worst the busiest device's work."""
    return max(planning.t_step(healthy), bound_step(planning.profile, plan))


class RecyclePolicy(Policy):
    """Reroute into the bubbles; restart on an even plan when rerouting is impossible."""

    def __init__(self, name: str, setup):
        super().__init__(name, setup)
        self.healthy: Plan | None = None  # the plan before any reroute

    def start(self) -> Plan:
        self.healthy = require_equal_pipelines(self.setup.plan, self.name)
        return self.healthy

    def t_step(self, plan: Plan) -> float:
        return recycle_step(self.planning, plan, self.healthy) if plan.reroutes else self.planning.t_step(plan)

    def on_fault(self, plan: Plan, fault: Fault) -> Response:
        profile = self.planning.profile
        try:
            rerouted = reroute_plan(plan, set(fault.failed))
            fits = max(est.memory_per_device(profile, rerouted).values()) <= profile.memory_bytes
        except PlanError:
            fits = False
        if fits:
            return Response(rerouted, est.rebuild_time(profile, rerouted), self.t_step(rerouted), "reroute")
        geometry = geometry_of(plan)
        alive = tp_units(set(range(self.setup.n_devices)) - fault.dead, geometry.width)
        new = self.planning.best_even(alive, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size)
        if new is None or geometry.lost(fault.failed):
            return Response(None, 0.0, float("inf"), "halt")
        self.healthy = new
        return rebuild_response(self.planning, plan, new, "restart", extra_s=profile.restart_s)

    def on_rejoin(self, plan: Plan, rejoin: Rejoin) -> Response | None:
        tp = geometry_of(plan).width
        new, _ = refill_rerouted(plan, tp_units(rejoin.back, tp))
        profile = self.planning.profile
        if new is not None:
            pause = est.migration_time(profile, plan, new)[0] + est.rebuild_time(profile, new)
            return Response(new, pause, self.t_step(new), "rejoin")
        alive = tp_units(set(range(self.setup.n_devices)) - rejoin.dead, tp)
        bigger = self.planning.best_even(alive, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size)
        if plan.reroutes or bigger is None or bigger.global_batch / self.t_step(bigger) <= plan.global_batch / self.t_step(plan):
            return None
        self.healthy = bigger
        return rebuild_response(self.planning, plan, bigger, "restart_bigger", extra_s=profile.restart_s)
