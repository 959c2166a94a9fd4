"""torchft 0.2.0 (pytorch/torchft): a replica group drops out on a fault and heals when it returns.

Modelled:

- Replica groups are the pipelines of the starting plan, which must be even
  (every group shards the model the same way: torchft wraps DDP/HSDP across groups).
- A fault in a group removes the whole group (torchft's failure domain); its
  samples are dropped, so the global batch shrinks (``Manager.allreduce``
  averages over the participants).
- The survivors pause for the stuck collective to time out before the next
  quorum (the breakdown's ``detection``): ``sim.torchft.timeout_s`` (60 s, ``torchft.Manager``'s default
  ``timeout``; ``benchmarks/bench_torchft.py`` measures this wait on gloo), then
  rebuild their process group (the estimator's group-creation cost).
- A group heals once all its devices are back: it fetches weights and optimizer
  state from a live group (the estimator's migration time at the DP bandwidth)
  and every group rebuilds its process group for the new quorum.

Left out: the Lighthouse's heartbeat and join timeouts (sub-second to seconds,
below the collective timeout), LocalSGD/DiLoCo modes, and spare groups.
"""

from __future__ import annotations

from chameleon.decision import estimator as est
from chameleon.layout.plan import Pipeline, Plan
from chameleon.sim.policies import Fault, Policy, Rejoin, Response, rebuild_response, require_equal_pipelines


class TorchftPolicy(Policy):
    """Drop the replica group that lost a device; heal it when all its devices are back."""

    def __init__(self, name: str, setup):
        super().__init__(name, setup)
        self.dropped: list[Pipeline] = []

    def start(self) -> Plan:
        return require_equal_pipelines(self.setup.plan, self.name)

    def on_fault(self, plan: Plan, fault: Fault) -> Response:
        kept = tuple(p for p in plan.pipelines if not fault.failed & set(p.devices))
        self.dropped += [p for p in plan.pipelines if fault.failed & set(p.devices)]
        if not kept:
            return Response(None, 0.0, float("inf"), "halt")
        new = Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=kept)
        parts = {"detection": self.setup.sim.torchft.timeout_s, "restore": est.rebuild_time(self.planning.profile, new)}
        return Response(new, sum(parts.values()), self.planning.t_step(new), "drop_replica", parts=parts)

    def on_rejoin(self, plan: Plan, rejoin: Rejoin) -> Response | None:
        back = [p for p in self.dropped if not rejoin.dead & set(p.devices)]
        if not back:
            return None
        self.dropped = [p for p in self.dropped if p not in back]
        new = Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=plan.pipelines + tuple(back))
        return rebuild_response(self.planning, plan, new, "heal")
