"""Checkpoint-restart: Young/Daly checkpoints, and a full job restart on every fault.

Modelled:

- The job writes a checkpoint every ``sqrt(2·δ·MTBF)`` (Young 1974, Daly 2006),
  ``δ`` the time to write weights + optimizer state at ``cluster.checkpoint_gbps``,
  MTBF the trace's nominal cluster MTBF; each write pauses training for ``δ``
  (the engine does the writes).
- A fault restarts the job on the fastest *even* plan (what Megatron-style
  frameworks run) over every live device: a relaunch of ``cluster.restart_s``
  (180 s on the Ascend preset: FlashRecovery, arXiv 2509.03047, restores a
  4,800-device job in 150 s; the Llama 3 run's ≥ 90 % effective training time
  with 419 interruptions in 54 days bounds a whole interruption, rollback
  included, at ≤ 18.6 min), a reload at the checkpoint bandwidth, and the loss
  of every step since the last checkpoint.
- Repaired devices: when the best even plan over the live devices beats the
  running one, the job writes a checkpoint and restarts onto it (a write, a
  relaunch and a reload; nothing rolled back).

Left out: asynchronous or in-memory checkpoints (Gemini, CheckFreq), which shrink
``δ``, and waiting for replacement hardware.
"""

from __future__ import annotations

from chameleon.decision import estimator as est
from chameleon.layout.geometry import geometry_of, tp_units
from chameleon.layout.plan import Plan
from chameleon.sim.policies import Fault, Policy, Rejoin, Response


class CheckpointPolicy(Policy):
    """Restart from the newest checkpoint on the best even plan of the live devices."""

    checkpoints = "blocking"

    def _even(self, plan: Plan, alive: set[int]) -> Plan | None:
        units = tp_units(alive, geometry_of(plan).width)
        return self.planning.best_even(units, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size)

    def on_fault(self, plan: Plan, fault: Fault) -> Response:
        alive = set(range(self.setup.n_devices)) - fault.dead
        new = self._even(plan, alive)
        if new is None:
            return Response(None, 0.0, float("inf"), "halt")
        profile = self.planning.profile
        pause = profile.restart_s + est.checkpoint_time(profile, plan.n_layers)
        return Response(new, pause, self.planning.t_step(new), "checkpoint", rollback=True)

    def on_rejoin(self, plan: Plan, rejoin: Rejoin) -> Response | None:
        new = self._even(plan, set(range(self.setup.n_devices)) - rejoin.dead)
        if new is None or new.global_batch / self.t_step(new) <= plan.global_batch / self.t_step(plan):
            return None
        profile = self.planning.profile
        pause = profile.restart_s + 2 * est.checkpoint_time(profile, plan.n_layers)
        return Response(new, pause, self.t_step(new), "restart_bigger")
