"""Discrete-event simulation of a long training run under a fault trace.

Between events the job trains at its policy's step time on the current plan; an
event (a fault, a re-join, a checkpoint write) is handled by the policy
(:mod:`chameleon.sim.policies`, :mod:`chameleon.sim.baselines`), which returns a
plan and a transition pause. Time is classified, summing to the horizon:

- ``useful``: committed samples ÷ the reference throughput (the planner's best
  failure-free plan on the full cluster);
- ``degraded``: the rest of committed steps' time (slower or smaller steps);
- ``transition``: recovery pauses and checkpoint writes;
- ``lost``: steps a fault aborted, progress a checkpoint reload discarded, and
  time after the job could not go on.

The step cut by the horizon is credited pro rata: the run goes on past the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chameleon.decision import estimator as est
from chameleon.decision.config import PolicyConfig
from chameleon.layout.geometry import geometry_of, tp_units
from chameleon.layout.plan import Plan
from chameleon.report.progress import progress_bar
from chameleon.sim import policies as pol
from chameleon.sim.baselines.bamboo import BambooPolicy
from chameleon.sim.baselines.checkpoint import CheckpointPolicy
from chameleon.sim.baselines.elaswave import ElasWavePolicy
from chameleon.sim.baselines.oobleck import OobleckPolicy
from chameleon.sim.baselines.recycle import RecyclePolicy
from chameleon.sim.baselines.torchft import TorchftPolicy
from chameleon.sim.config import SimConfig, SimPolicy
from chameleon.sim.traces import Event

POLICY_CLASSES: dict[str, type[pol.Policy]] = {
    **dict.fromkeys(pol.ChameleonPolicy.SELECTOR, pol.ChameleonPolicy),
    "elaswave": ElasWavePolicy, "oobleck": OobleckPolicy, "recycle": RecyclePolicy, "bamboo": BambooPolicy,
    "checkpoint": CheckpointPolicy, "torchft": TorchftPolicy,
}


@dataclass
class Setup:
    """Everything a run needs besides the policy and the trace.

    ``plan`` is every policy's starting plan (the recipe's or the planner's, one for all); ``reference``
    the planner's best failure-free plan on the full cluster, the denominator of
    every ratio; ``domains`` the device groups the trace fails together (None:
    devices fail alone), which Chameleon's selector weighs.
    """

    planning: pol.Planning
    plan: Plan
    reference: Plan
    policy: PolicyConfig
    sim: SimConfig
    mtbf_s: float
    n_devices: int
    domains: tuple[tuple[int, ...], ...] | None = None

    @property
    def reference_throughput(self) -> float:
        return self.reference.global_batch / self.planning.t_step(self.reference)

    @property
    def units(self) -> list[tuple[int, ...]]:
        """Every stage unit of the cluster at the starting plan's TP width, idle ones included."""
        return tp_units(range(self.n_devices), geometry_of(self.plan).width)


@dataclass
class RunResult:
    """One policy on one trace: throughput, time breakdown, each recovery, a rate timeline."""

    policy: str
    horizon_s: float
    samples: float
    reference_throughput: float
    initial_throughput: float
    breakdown: dict[str, float]
    recoveries: list[dict]
    timeline: list[tuple[float, float, float]]  # (start s, end s, samples/s)
    halted_at: float | None = None

    @property
    def throughput(self) -> float:
        return self.samples / self.horizon_s

    def to_dict(self) -> dict:
        return {
            "policy": self.policy, "horizon_s": self.horizon_s, "samples": self.samples, "throughput": self.throughput,
            "reference_throughput": self.reference_throughput, "initial_throughput": self.initial_throughput,
            "breakdown": self.breakdown, "recoveries": self.recoveries, "halted_at": self.halted_at,
        }


class _Run:
    """Mutable state of one simulated run."""

    def __init__(self, name: str, plan: Plan, t_step: float, reference: float, horizon_s: float):
        self.name, self.horizon = name, horizon_s
        self.plan: Plan | None = plan
        self.t_step = t_step
        self.reference = reference
        self.now = self.resume_at = 0.0
        self.samples = 0.0
        self.acc = dict.fromkeys(("useful", "degraded", "transition", "lost"), 0.0)
        self.timeline: list[tuple[float, float, float]] = []
        self.halted_at: float | None = None

    def advance(self, to: float, *, abort: bool) -> None:
        """Train from ``now`` to ``to``; with ``abort`` the unfinished step is lost."""
        to = min(to, self.horizon)
        if to <= self.now:
            return
        paused = min(max(self.resume_at - self.now, 0.0), to - self.now)
        self._mark(self.now, self.now + paused, 0.0)
        self.acc["transition"] += paused
        start = self.now + paused
        span = to - start
        if span > 0 and self.plan is None:
            self.acc["lost"] += span
            self._mark(start, to, 0.0)
        elif span > 0:
            steps = span / self.t_step
            if abort:
                steps = math.floor(steps + 1e-9)
            done = steps * self.t_step
            samples = steps * self.plan.global_batch
            useful = min(done, samples / self.reference)
            self.samples += samples
            self.acc["useful"] += useful
            self.acc["degraded"] += done - useful
            self.acc["lost"] += span - done
            self._mark(start, to, self.plan.global_batch / self.t_step)
        self.now = to

    def _mark(self, start: float, end: float, rate: float) -> None:
        if end <= start:
            return
        if self.timeline and self.timeline[-1][2] == rate and self.timeline[-1][1] == start:
            self.timeline[-1] = (self.timeline[-1][0], end, rate)
        else:
            self.timeline.append((start, end, rate))

    def adopt(self, response: pol.Response) -> None:
        self.plan, self.t_step = response.plan, response.t_step
        self.resume_at = self.now + response.pause_s
        if response.plan is None and self.halted_at is None:
            self.halted_at = self.now


def make_policy(name: str, setup: Setup) -> pol.Policy:
    """The policy ``name`` of ``sim.policies`` on ``setup``.

    Raises:
        ValueError: On an unknown policy name.
    """
    if name not in POLICY_CLASSES:
        raise ValueError(f"sim.policies: unknown policy {name!r}; use {', '.join(SimPolicy)}")
    return POLICY_CLASSES[name](name, setup)


def simulate(setup: Setup, name: str, events: tuple[Event, ...], *, horizon_s: float, progress: bool = False) -> RunResult:
    """Run policy ``name`` over ``events`` for ``horizon_s`` seconds.

    Raises:
        ValueError: On an unknown policy name, or a baseline that cannot lay out the cluster.
    """
    policy = make_policy(name, setup)
    first = policy.start()
    ref = setup.reference_throughput
    run = _Run(name, first, policy.t_step(first), ref, horizon_s)
    initial = first.global_batch / run.t_step
    dead: set[int] = set()
    fault_times: list[float] = []
    removals = [e.time_s for e in events if e.kind == "remove"]
    recoveries: list[dict] = []
    saves = _Saves(setup, run, blocking=policy.checkpoints == "blocking") if policy.checkpoints else None
    for event in progress_bar(events, desc=name, wanted=progress, leave=False):
        if event.time_s >= horizon_s:
            break
        if saves:
            saves.until(event.time_s)
        next_fault = next((t for t in removals if t > event.time_s), horizon_s)
        d_true = min(next_fault, horizon_s) - event.time_s
        if event.kind == "remove":
            hit = set(event.devices) - dead
            dead |= hit
            fault_times.append(event.time_s)
            failed = hit & set(run.plan.devices) if run.plan is not None else set()
            if not failed:
                continue
            run.advance(event.time_s, abort=True)
            if saves:
                saves.interrupt(event.time_s)
            response = policy.on_fault(run.plan, pol.Fault(
                event.time_s, frozenset(failed), frozenset(dead), tuple(fault_times[:-1]), d_true,
                *(saves.fallback(event.time_s) if saves else ()),
            ))
            if response.rollback:
                saves.rollback()
            run.adopt(response)
            ratio = 0.0 if response.plan is None else response.plan.global_batch / response.t_step / ref
            recoveries.append({
                "kind": "fault", "time_s": event.time_s, "failed": sorted(failed), "choice": response.choice, "pause_s": response.pause_s,
                "t_step": response.t_step, "post_over_reference": ratio, "d_s": response.d_s,
                "devices_left": setup.n_devices - len(dead),
            })
        else:
            back = set(event.devices) & dead
            dead -= back
            if run.plan is None or not back:
                continue
            run.advance(event.time_s, abort=False)
            response = policy.on_rejoin(run.plan, pol.Rejoin(
                event.time_s, frozenset(back), frozenset(dead), tuple(fault_times), d_true,
                *(saves.fallback(event.time_s) if saves else ()),
            ))
            if response is not None:
                run.adopt(response)
                recoveries.append({
                    "kind": "rejoin", "time_s": event.time_s, "failed": [], "choice": response.choice, "pause_s": response.pause_s,
                    "t_step": response.t_step, "post_over_reference": response.plan.global_batch / response.t_step / ref,
                    "d_s": response.d_s, "devices_left": setup.n_devices - len(dead),
                })
    if saves:
        saves.until(horizon_s)
    run.advance(horizon_s, abort=False)
    return RunResult(name, horizon_s, run.samples, ref, initial, run.acc, recoveries, run.timeline, run.halted_at)


class _Saves:
    """Checkpoint writes every Young/Daly interval ``sqrt(2·δ·MTBF)``.

    A blocking write (checkpoint-restart) pauses training for ``δ``; an asynchronous
    one (Chameleon's runtime: each device writes its own shard in the background)
    trains on and becomes the fallback once written, ``δ`` after its snapshot; a
    fault during the write discards it.
    """

    def __init__(self, setup: Setup, run: _Run, *, blocking: bool):
        self.run, self.blocking = run, blocking
        self.write_s = est.checkpoint_time(setup.planning.profile, setup.plan.n_layers)
        self.interval_s = math.sqrt(2 * self.write_s * setup.mtbf_s)
        self.next_s = self.interval_s
        self.saved = (0.0, 0.0, dict(run.acc))  # (time, samples, breakdown) at the last checkpoint
        self.writing: tuple[float, float, dict] | None = None  # an asynchronous write not yet landed

    def until(self, t: float) -> None:
        """Write every checkpoint due before ``t``."""
        run = self.run
        while self.next_s < min(t, run.horizon) and run.plan is not None:
            run.advance(self.next_s, abort=False)
            snapshot = (run.now, run.samples, dict(run.acc))
            if self.blocking:
                self.saved = snapshot
                run.resume_at = max(run.resume_at, run.now) + self.write_s
                self.next_s = run.resume_at + self.interval_s
            else:
                self._land(run.now)
                self.writing = snapshot
                self.next_s = run.now + self.interval_s
        self._land(t)

    def _land(self, t: float) -> None:
        if self.writing is not None and self.writing[0] + self.write_s <= t:
            self.saved, self.writing = self.writing, None

    def interrupt(self, t: float) -> None:
        """A fault at ``t``: a write still in flight never lands."""
        self._land(t)
        self.writing = None

    def fallback(self, t: float) -> tuple[float, float]:
        """The newest checkpoint's age at ``t`` and the interval between writes."""
        return t - self.saved[0], self.interval_s

    def rollback(self) -> None:
        """Discard the progress since the last checkpoint: its training time becomes lost."""
        run = self.run
        _, samples, acc = self.saved
        redone = sum(run.acc[k] - acc[k] for k in ("useful", "degraded"))
        run.samples = samples
        run.acc["useful"], run.acc["degraded"] = acc["useful"], acc["degraded"]
        run.acc["lost"] += redone
        self.saved = (run.now, samples, dict(run.acc))
