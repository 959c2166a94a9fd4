"""Fail-slow treated as fail-stop: the practice FALCON reports (Wu et al., arXiv 2410.12588, abstract: fail-slows
are "manually detect[ed]" and treated "as fail-stops using a checkpoint-and-restart failover approach").

Modelled:

- Faults: checkpoint-restart (:mod:`.checkpoint`), its Young/Daly writes set for the trace's faults and every
  fail-slow onset, each a restart it may have to make.
- A device slow for ``sim.failstop.detect_s`` (600 s, an assumption: an operator's minutes; FALCON gives no
  figure) is treated as failed: the job restarts from its newest checkpoint on the best even plan without it,
  losing the progress since.
- Back to speed, the device returns like a repaired one: a restart onto it when the bigger even plan is faster.
- Until it is noticed, the job trains at the slow device's pace.
"""

from __future__ import annotations

from dataclasses import replace

from chameleon.layout.plan import Plan
from chameleon.sim.baselines.checkpoint import CheckpointPolicy
from chameleon.sim.policies import Fault, Rejoin, Response, SpeedChange


class FailstopPolicy(CheckpointPolicy):
    """Checkpoint-restart, a slow device counted among the failed ones while it is slow."""

    def __init__(self, name: str, setup):
        super().__init__(name, setup)
        self.benched: frozenset[int] = frozenset()  # slow devices it treats as failed

    @property
    def checkpoint_mtbf_s(self) -> float:
        return 1 / (1 / self.setup.mtbf_s + 1 / self.setup.slow_mtbf_s)

    def slow_delay_s(self, t_step: float, *, onset: bool) -> float | None:
        """An operator's detection delay for a slowdown; a recovery is seen at once, as a repair."""
        return self.setup.sim.failstop.detect_s if onset else 0.0

    def on_fault(self, plan: Plan, fault: Fault) -> Response:
        return super().on_fault(plan, replace(fault, dead=fault.dead | self.benched))

    def on_rejoin(self, plan: Plan, rejoin: Rejoin) -> Response | None:
        return super().on_rejoin(plan, replace(rejoin, dead=rejoin.dead | self.benched))

    def on_slow(self, plan: Plan, change: SpeedChange) -> Response | None:
        """Restart without the newly slow devices of ``plan``; once none is, onto the ones back to speed."""
        slow = frozenset(change.speeds)
        newly, back = (slow - self.benched) & plan.device_set, self.benched - slow - change.dead
        self.benched = slow
        fallback = (change.checkpoint_age_s, change.checkpoint_interval_s)
        if newly:
            response = self.on_fault(plan, Fault(change.now_s, newly, change.dead, change.fault_times,
                                                 change.next_fault_s, *fallback))
            return response if response.plan is None else replace(response, choice="restart_without_slow")
        if back:
            return self.on_rejoin(plan, Rejoin(change.now_s, back, change.dead, change.fault_times, change.next_fault_s,
                                               *fallback))
        return None
