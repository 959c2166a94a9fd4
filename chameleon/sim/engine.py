"""Discrete-event simulation of a long training run under a fault trace.

Between events the job trains at its policy's step time on the current plan,
stretched by the estimator's figure at the slow devices' speeds; an event (a
fault, a re-join, a checkpoint write, a slow device noticed by the policy's
detector) is handled by the policy (:mod:`chameleon.sim.policies`,
:mod:`chameleon.sim.baselines`), which returns a plan and a pause. Time is
classified by :data:`~chameleon.report.breakdown.TIME_PARTS`, summing to the horizon:

- ``productive``: committed samples ÷ the reference throughput (the planner's best
  failure-free plan on the full cluster);
- ``degraded``: the rest of committed steps' time (slower or smaller steps, slow devices);
- ``detection``, ``decision``, ``restore``: recovery pauses, split where the policy
  knows its parts (else ``restore``);
- ``checkpoint``: blocking checkpoint writes;
- ``redone``: steps a fault aborted, progress a checkpoint reload discarded;
- ``shutdown``: time after the job could not go on.

``evaluation`` and ``startup`` are not simulated (0). The step cut by the horizon
is credited pro rata: the run goes on past the window.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field

from chameleon.config import FaultToleranceConfig
from chameleon.decision import estimator as est
from chameleon.decision.config import PolicyConfig
from chameleon.layout.geometry import geometry_of, tp_units
from chameleon.layout.plan import Plan
from chameleon.report.breakdown import empty, ettr
from chameleon.report.progress import progress_bar
from chameleon.sim import policies as pol
from chameleon.sim.baselines.bamboo import BambooPolicy
from chameleon.sim.baselines.checkpoint import CheckpointPolicy
from chameleon.sim.baselines.elaswave import ElasWavePolicy
from chameleon.sim.baselines.failstop import FailstopPolicy
from chameleon.sim.baselines.oobleck import OobleckPolicy
from chameleon.sim.baselines.recycle import RecyclePolicy
from chameleon.sim.baselines.torchft import TorchftPolicy
from chameleon.sim.config import SimConfig, SimPolicy
from chameleon.sim.traces import Event

POLICY_CLASSES: dict[str, type[pol.Policy]] = {
    **dict.fromkeys(pol.ChameleonPolicy.SELECTOR, pol.ChameleonPolicy),
    "elaswave": ElasWavePolicy, "oobleck": OobleckPolicy, "recycle": RecyclePolicy, "bamboo": BambooPolicy,
    "checkpoint": CheckpointPolicy, "torchft": TorchftPolicy, "failstop": FailstopPolicy,
}


@dataclass
class Setup:
    """Everything a run needs besides the policy and the trace.

    ``plan`` is every policy's starting plan (the recipe's or the planner's, one for all); ``reference``
    the planner's best failure-free plan on the full cluster, the denominator of
    every ratio; ``domains`` the device groups the trace fails together (None:
    devices fail alone), which Chameleon's selector weighs; ``slow_mtbf_s`` the cluster's mean time between
    fail-slow onsets; ``ft`` the runtime's fail-slow detector (``ft.slow*``).
    """

    planning: pol.Planning
    plan: Plan
    reference: Plan
    policy: PolicyConfig
    sim: SimConfig
    mtbf_s: float
    n_devices: int
    domains: tuple[tuple[int, ...], ...] | None = None
    slow_mtbf_s: float = math.inf
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    tp_sizes: tuple[int, ...] = ()  # the TP sizes the model allows: a broken TP group may be re-formed at one

    @property
    def reference_throughput(self) -> float:
        return self.reference.global_batch / self.planning.t_step(self.reference)

    @property
    def units(self) -> list[tuple[int, ...]]:
        """Every stage unit of the cluster at the starting plan's TP width, idle ones included."""
        return tp_units(range(self.n_devices), geometry_of(self.plan).width)


@dataclass
class RunResult:
    """One policy on one trace: throughput, time breakdown (:data:`~chameleon.report.breakdown.TIME_PARTS`), each
    recovery and reaction to slow devices, a rate timeline."""

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

    @property
    def ettr(self) -> float:
        """The effective-training-time ratio: productive time over the horizon."""
        return ettr(self.breakdown)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy, "horizon_s": self.horizon_s, "samples": self.samples, "throughput": self.throughput,
            "reference_throughput": self.reference_throughput, "initial_throughput": self.initial_throughput,
            "ettr": self.ettr, "breakdown": self.breakdown, "recoveries": self.recoveries, "halted_at": self.halted_at,
        }


class _Run:
    """Mutable state of one simulated run: the plan, its step time at full speed and now, pauses still to sit out."""

    def __init__(self, name: str, plan: Plan, t_step: float, reference: float, horizon_s: float):
        self.name, self.horizon = name, horizon_s
        self.plan: Plan | None = plan
        self.base_step = self.t_step = t_step
        self.reference = reference
        self.now = 0.0
        self.pauses: list[list] = []  # [part, seconds left], sat out in order
        self.samples = 0.0
        self.acc = empty()
        self.timeline: list[tuple[float, float, float]] = []
        self.halted_at: float | None = None

    @property
    def resume_at(self) -> float:
        return self.now + sum(left for _, left in self.pauses)

    def pause(self, part: str, seconds: float) -> None:
        """Sit out ``seconds`` of ``part`` after the pauses already due."""
        if seconds > 0:
            self.pauses.append([part, seconds])

    def advance(self, to: float, *, abort: bool) -> None:
        """Train from ``now`` to ``to``; with ``abort`` the unfinished step is lost."""
        to = min(to, self.horizon)
        if to <= self.now:
            return
        start = self.now
        while self.pauses and start < to:
            part, left = self.pauses[0]
            spent = min(left, to - start)
            self.acc[part] += spent
            start += spent
            if spent < left:
                self.pauses[0][1] = left - spent
            else:
                self.pauses.pop(0)
        self._mark(self.now, start, 0.0)
        span = to - start
        if span > 0 and self.plan is None:
            self.acc["shutdown"] += span
            self._mark(start, to, 0.0)
        elif span > 0:
            steps = span / self.t_step
            if abort:
                steps = math.floor(steps + 1e-9)
            done = steps * self.t_step
            samples = steps * self.plan.global_batch
            productive = min(done, samples / self.reference)
            self.samples += samples
            self.acc["productive"] += productive
            self.acc["degraded"] += done - productive
            self.acc["redone"] += span - done
            self._mark(start, to, self.plan.global_batch / self.t_step)
        self.now = to

    def _mark(self, start: float, end: float, rate: float) -> None:
        if end <= start:
            return
        if self.timeline and self.timeline[-1][2] == rate and self.timeline[-1][1] == start:
            self.timeline[-1] = (self.timeline[-1][0], end, rate)
        else:
            self.timeline.append((start, end, rate))

    def adopt(self, response: pol.Response, *, queued: bool = False) -> None:
        """Run ``response``'s plan after its pause: after the pauses due (``queued``) or instead of them."""
        self.plan, self.base_step = response.plan, response.t_step
        if not queued:
            self.pauses = []
        for part, seconds in response.pause_parts.items():
            self.pause(part, seconds)
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
    replay = _Replay(setup, make_policy(name, setup), events, horizon_s)
    for event in progress_bar(events, desc=name, wanted=progress, leave=False):
        if event.time_s >= horizon_s:
            break
        replay.until(event.time_s)
        replay.handle(event)
    replay.until(horizon_s)
    return replay.result()


class _Replay:
    """One policy replaying one trace: its run, the devices' true state and what its detector has noticed of their
    speeds, checkpoint writes.

    A change of a device's speed is noticed ``policy.slow_delay_s`` later if the device kept that speed until then
    (a shorter blip goes unnoticed); the policy then answers every device it has noticed slow.
    """

    def __init__(self, setup: Setup, policy: pol.Policy, events: tuple[Event, ...], horizon_s: float):
        self.setup, self.policy, self.horizon = setup, policy, horizon_s
        first = policy.start()
        self.ref = setup.reference_throughput
        self.run = _Run(policy.name, first, policy.t_step(first), self.ref, horizon_s)
        self.initial = first.global_batch / self.run.t_step
        self.dead: set[int] = set()
        self.fault_times: list[float] = []
        self.removals = [e.time_s for e in events if e.kind == "remove"]
        self.recovered: dict[int, list[float]] = {}  # each device's recover times, in order
        for e in events:
            if e.kind == "recover":
                self.recovered.setdefault(e.devices[0], []).append(e.time_s)
        self.speeds: dict[int, float] = {}  # the slow devices' time factors, true
        self.noticed: dict[int, float] = {}  # as the policy's detector has seen them
        self.changes: dict[int, int] = {}  # speed changes per device: a check of an older one is stale
        self.checks: list[tuple[float, int, int, int]] = []  # (when, order, device, its change count then)
        self.order = itertools.count()
        self.recoveries: list[dict] = []
        self.saves = _Saves(setup, self.run, blocking=policy.checkpoints == "blocking", mtbf_s=policy.checkpoint_mtbf_s) \
            if policy.checkpoints else None

    def until(self, t: float) -> None:
        """Notice the speed changes due before ``t`` and write the checkpoints due."""
        while self.checks and self.checks[0][0] < t:
            when, _, device, count = heapq.heappop(self.checks)
            if self.saves:
                self.saves.until(when)
            self._notice(when, device, count)
        if self.saves:
            self.saves.until(t)

    def handle(self, event: Event) -> None:
        if event.kind == "remove":
            self._fault(event)
        elif event.kind == "add":
            self._rejoin(event)
        else:
            self._speed(event)

    def result(self) -> RunResult:
        run = self.run
        run.advance(self.horizon, abort=False)
        return RunResult(run.name, self.horizon, run.samples, self.ref, self.initial, run.acc, self.recoveries,
                         run.timeline, run.halted_at)

    def _fallback(self, t: float) -> tuple[float, ...]:
        return self.saves.fallback(t) if self.saves else ()

    def _next_fault_s(self, t: float) -> float:
        """True time from ``t`` to the next fault (or the horizon)."""
        i = bisect.bisect_right(self.removals, t)
        return min(self.removals[i] if i < len(self.removals) else self.horizon, self.horizon) - t

    def _fault(self, event: Event) -> None:
        run, t = self.run, event.time_s
        hit = set(event.devices) - self.dead
        self.dead |= hit
        self.fault_times.append(t)
        failed = hit & run.plan.device_set if run.plan is not None else set()
        if not failed:
            return
        run.advance(t, abort=True)
        if self.saves:
            self.saves.interrupt(t)
        response = self.policy.on_fault(run.plan, pol.Fault(
            t, frozenset(failed), frozenset(self.dead), tuple(self.fault_times[:-1]), self._next_fault_s(t),
            *self._fallback(t),
        ))
        self._adopt("fault", t, sorted(failed), response, queued=False)

    def _rejoin(self, event: Event) -> None:
        run, t = self.run, event.time_s
        back = set(event.devices) & self.dead
        self.dead -= back
        if run.plan is None or not back:
            return
        run.advance(t, abort=False)
        response = self.policy.on_rejoin(run.plan, pol.Rejoin(
            t, frozenset(back), frozenset(self.dead), tuple(self.fault_times), self._next_fault_s(t), *self._fallback(t),
        ))
        if response is not None:
            self._adopt("rejoin", t, [], response, queued=False)

    def _speed(self, event: Event) -> None:
        """A device slows down or gets back to speed: the step stretches or shrinks now; the policy's detector sees
        it later, if it lasts."""
        run, t, (device,) = self.run, event.time_s, event.devices
        run.advance(t, abort=False)
        if event.kind == "slow":
            self.speeds[device] = event.factor
        else:
            self.speeds.pop(device, None)
        self._retime()
        self.changes[device] = self.changes.get(device, 0) + 1
        delay = self.policy.slow_delay_s(run.t_step, onset=event.kind == "slow")
        if delay is not None and run.plan is not None:
            heapq.heappush(self.checks, (t + delay, next(self.order), device, self.changes[device]))

    def _notice(self, t: float, device: int, count: int) -> None:
        """The detector's verdict on ``device`` at ``t``, if its speed held since the change checked."""
        factor = self.speeds.get(device, 1.0)
        if self.changes[device] != count or self.noticed.get(device, 1.0) == factor or self.run.plan is None:
            return
        if factor == 1.0:
            del self.noticed[device]
        else:
            self.noticed[device] = factor
        self._react(t)

    def _react(self, t: float) -> None:
        """The policy answers the slow devices it has noticed (none: all back to speed)."""
        run = self.run
        run.advance(t, abort=False)
        remaining = max((self._episode_end(d, t) - t for d in self.noticed), default=0.0)
        response = self.policy.on_slow(run.plan, pol.SpeedChange(
            t, dict(self.noticed), frozenset(self.dead), tuple(self.fault_times), self._next_fault_s(t), remaining,
            *self._fallback(t),
        ))
        if response is None:
            return
        if response.plan == run.plan and response.pause_s == 0:  # tolerated: the running plan goes on as it is
            self._record("slow", t, sorted(self.noticed), response)
            return
        self._adopt("slow", t, sorted(self.noticed), response, queued=True)

    def _episode_end(self, device: int, t: float) -> float:
        """When the slowness of ``device`` under way at ``t`` truly ends (the horizon if after it)."""
        ends = self.recovered.get(device, [])
        i = bisect.bisect_right(ends, t)
        return ends[i] if i < len(ends) else self.horizon

    def _adopt(self, kind: str, t: float, devices: list[int], response: pol.Response, *, queued: bool) -> None:
        """Run ``response``; after a fault or a re-join, slow devices noticed in its plan are decided again at once."""
        if response.rollback:
            self.saves.rollback()
        self.run.adopt(response, queued=queued)
        self._retime()
        self._record(kind, t, devices, response)
        plan = self.run.plan
        if kind != "slow" and plan is not None and set(self.noticed) & plan.device_set \
                and self.policy.slow_delay_s(self.run.t_step, onset=True) is not None:
            self._react(t)

    def _retime(self) -> None:
        run = self.run
        run.t_step = math.inf if run.plan is None else run.base_step * self.policy.slowdown(run.plan, self.speeds)

    def _record(self, kind: str, t: float, devices: list[int], response: pol.Response) -> None:
        plan, t_step = self.run.plan, self.run.t_step
        self.recoveries.append({
            "kind": kind, "time_s": t, "failed": devices, "choice": response.choice, "pause_s": response.pause_s,
            "t_step": t_step, "post_over_reference": 0.0 if plan is None else plan.global_batch / t_step / self.ref,
            "d_s": response.d_s, "devices_left": self.setup.n_devices - len(self.dead),
        })


class _Saves:
    """Checkpoint writes every Young/Daly interval ``sqrt(2·δ·MTBF)``.

    A blocking write (checkpoint-restart) pauses training for ``δ``; an asynchronous
    one (Chameleon's runtime: each device writes its own shard in the background)
    trains on and becomes the fallback once written, ``δ`` after its snapshot; a
    fault during the write discards it.
    """

    def __init__(self, setup: Setup, run: _Run, *, blocking: bool, mtbf_s: float):
        self.run, self.blocking = run, blocking
        self.write_s = est.checkpoint_time(setup.planning.profile, setup.plan.n_layers)
        self.interval_s = math.sqrt(2 * self.write_s * mtbf_s)
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
                run.pause("checkpoint", self.write_s)
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
        """Discard the progress since the last checkpoint: its training time is to be redone."""
        run = self.run
        _, samples, acc = self.saved
        redone = sum(run.acc[k] - acc[k] for k in ("productive", "degraded"))
        run.samples = samples
        run.acc["productive"], run.acc["degraded"] = acc["productive"], acc["degraded"]
        run.acc["redone"] += redone
        self.saved = (run.now, samples, dict(run.acc))
