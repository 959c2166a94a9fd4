"""Bamboo (NSDI'23): redundant computation, as Oobleck's artifact simulates it.

Bamboo's stage ``s`` keeps a shadow of stage ``s+1`` and runs its forward in the
1F1B bubbles (eager redundant computation, ``get_redundant_stage_ids`` in
uclasystem/bamboo); when ``s+1`` fails, ``s`` takes its place. Modelled:

- Cost before any fault: each stage's forward grows by its successor's,
  ``(2 − hidden)×``, where ``hidden`` is the share the bubbles absorb,
  ``min(1, (pp−1)(t_f+t_b) / (m·t_f))`` for ``m`` micro-batches per pipeline
  (``sim.bamboo.hidden`` overrides it); the shadow's weights and optimizer
  state (no gradients: the shadow never runs backward before a fault) are
  charged to memory, so the plan that fits may be deeper.
- Layout: the fastest even plan under those costs, its depth fixed thereafter
  (Bamboo keeps ``num_stages_target``).
- A fault on a stage whose predecessor is alive and not already doubled up is a
  fail-over: the predecessor runs both stages (no pause). Otherwise it is fatal:
  a global rendezvous of ``sim.bamboo.fatal_restart_s`` (30 s in Oobleck's
  ``bamboo_simulator.py``) and a restart on as many full pipelines as the live
  devices allow.
- Oobleck's artifact then reconfigures whenever ``2·overloaded/active`` exceeds
  ``sim.bamboo.overload_threshold`` (5 %), when idle devices can relieve the
  overloaded ones, or when they can form another pipeline: a local rendezvous of
  ``sim.bamboo.reconfigure_s`` (450 s for GPT-3 6.7B, the artifact's figure for
  the closest model to Llama-2-7B) onto ``⌊live / pp⌋`` pipelines.

Left out: lazy redundancy, the shadow's per-step weight transfer, and the ring's
wrap-around (stage 0's fail-over merges into stage 1, which costs the same as
merging into the last stage but keeps layers contiguous).
"""

from __future__ import annotations

from dataclasses import replace

from chameleon.decision.profiler import Profile
from chameleon.layout.geometry import geometry_of, tp_units
from chameleon.layout.plan import Pipeline, Plan, Stage
from chameleon.sim.policies import Fault, Planning, Policy, Rejoin, Response


def bubble_hidden(profile: Profile, n_stages: int, n_micro: int) -> float:
    """Share of a successor's forward that the 1F1B bubbles of a uniform pipeline absorb."""
    fwd, bwd = profile.layer_fwd_s, profile.layer_bwd_s
    return min(1.0, (n_stages - 1) * (fwd + bwd) / (n_micro * fwd))


def redundant_profile(profile: Profile, *, hidden: float) -> Profile:
    """Forward ``(2 − hidden)×``; each layer's state also held once more as the shadow (weights + optimizer)."""
    return replace(profile, layer_fwd_s=profile.layer_fwd_s * (2.0 - hidden), shadow_bytes_per_param=profile.state.moved)


def failover(plan: Plan, j: int, s: int) -> Plan:
    """Pipeline ``j``'s stage ``s`` merged into its predecessor (stage 1 for stage 0)."""
    p = plan.pipelines[j]
    into = s - 1 if s > 0 else 1
    lo = min(p.stages[s].layers[0], p.stages[into].layers[0])
    hi = max(p.stages[s].layers[1], p.stages[into].layers[1])
    stages = tuple(replace(st, layers=(lo, hi)) if i == into else st for i, st in enumerate(p.stages) if i != s)
    pipes = tuple(Pipeline(stages=stages, micro_batches=q.micro_batches) if i == j else q for i, q in enumerate(plan.pipelines))
    return Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=pipes)


class BambooPolicy(Policy):
    """Fail over to the shadow-holding predecessor; reconfigure by Oobleck's Bamboo rules."""

    def __init__(self, name: str, setup):
        super().__init__(name, setup)
        self.depth = 0
        self.overloaded: set[int] = set()  # devices running two stages

    def start(self) -> Plan:
        base, plan, units = self.setup.planning, self.setup.plan, self.setup.units
        options = []
        for pp in base.planner.splits:
            dp = len(units) // pp
            if pp < 2 or not dp or plan.n_micro_batches % dp:  # a shadow needs a neighbour stage
                continue
            hidden = self.setup.sim.bamboo.hidden
            if hidden is None:
                hidden = bubble_hidden(base.profile, pp, plan.n_micro_batches // dp)
            planning = Planning(redundant_profile(base.profile, hidden=hidden), replace(self.setup.policy, pp_lengths=[pp]))
            even = planning.best_even(units, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size)
            if even is not None:
                options.append((planning.t_step(even), pp, planning, even))
        if not options:
            raise ValueError("sim.policies: bamboo finds no even plan whose shadow copies fit in memory")
        _, self.depth, self.planning, chosen = min(options, key=lambda o: o[:2])
        return chosen

    def _full_pipelines(self, plan: Plan, dead: frozenset[int]) -> Plan | None:
        """As many pipelines of the fixed depth as the live devices allow, micro-batches spread evenly."""
        units = tp_units(set(range(self.setup.n_devices)) - dead, geometry_of(plan).width)
        dp = min(len(units) // self.depth, plan.n_micro_batches)
        if dp == 0:
            return None
        bounds = self.planning.planner.splits[self.depth].bounds()
        base, extra = divmod(plan.n_micro_batches, dp)
        it = iter(units)
        pipes = tuple(
            Pipeline(stages=tuple(Stage(devices=next(it), layers=b, recompute=self.planning.profile.recompute)
                                  for b in bounds), micro_batches=base + (j < extra))
            for j in range(dp)
        )
        self.overloaded = set()
        return Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=pipes)

    def _reconfigure(self, plan: Plan, dead: frozenset[int], pause_s: float, choice: str) -> Response:
        new = self._full_pipelines(plan, dead)
        if new is None:
            return Response(None, 0.0, float("inf"), "halt")
        return Response(new, pause_s, self.planning.t_step(new), choice)

    def _should_reconfigure(self, plan: Plan, dead: frozenset[int]) -> bool:
        """The artifact's ``simulate_should_reconfigure``: relieve overload, or grow by a pipeline."""
        over = len(self.overloaded)
        active = plan.dp * self.depth - over
        idle = self.setup.n_devices - len(dead) - len(plan.devices)
        if over and (idle >= over or 2 * over / active > self.setup.sim.bamboo.overload_threshold):
            return True
        return (active + idle) // self.depth > plan.dp

    def on_fault(self, plan: Plan, fault: Fault) -> Response:
        cfg = self.setup.sim.bamboo
        new = plan
        for d in sorted(fault.failed):
            j, s = next((j, s) for j, p in enumerate(new.pipelines) for s, st in enumerate(p.stages) if d in st.devices)
            p = new.pipelines[j]
            into = s - 1 if s > 0 else 1
            fatal = d in self.overloaded or p.n_stages < 2 or fault.dead & set(p.stages[into].devices) or set(p.stages[into].devices) & self.overloaded
            if fatal:
                return self._reconfigure(plan, fault.dead, cfg.fatal_restart_s, "fatal_restart")
            self.overloaded |= set(p.stages[into].devices)
            new = failover(new, j, s)
        if self._should_reconfigure(new, fault.dead):
            return self._reconfigure(new, fault.dead, cfg.reconfigure_s, "failover+reconfigure")
        return Response(new, 0.0, self.planning.t_step(new), "failover")

    def on_rejoin(self, plan: Plan, rejoin: Rejoin) -> Response | None:
        if not self._should_reconfigure(plan, rejoin.dead):
            return None
        return self._reconfigure(plan, rejoin.dead, self.setup.sim.bamboo.reconfigure_s, "reconfigure")
