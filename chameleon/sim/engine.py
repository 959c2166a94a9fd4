"""Discrete-event simulation of a long training run under a fault trace.

Between events the job trains at the estimator's step time of its current plan;
an event (a fault, a re-join, a checkpoint write) is handled by the policy
(:mod:`chameleon.sim.policies`), which returns a plan and a transition pause.
Time is classified, summing to the horizon:

- ``useful``: committed steps, at the failure-free rate (samples × ``t_ff`` / ``B``);
- ``degraded``: the rest of committed steps' time (slower or smaller steps);
- ``transition``: recovery pauses and checkpoint writes;
- ``lost``: steps a fault aborted, progress a checkpoint reload discarded, and
  time after the job could not go on.

The step cut by the horizon is credited pro rata: the run goes on past the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tqdm import tqdm

from chameleon.decision import estimator as est
from chameleon.decision.config import PolicyConfig
from chameleon.layout.plan import Pipeline, Plan
from chameleon.sim import policies as pol
from chameleon.sim.traces import Event


@dataclass
class Setup:
    """Everything a run needs besides the policy and the trace."""

    planning: pol.Planning
    plan: Plan
    policy: PolicyConfig
    mtbf_s: float
    redundant_hidden: float = 0.0
    _redundant: pol.Planning | None = field(default=None, repr=False)

    def planning_for(self, name: str) -> pol.Planning:
        """The redundant policy plans and estimates on its slower profile; the others share one."""
        if name != "redundant":
            return self.planning
        if self._redundant is None:
            profile = pol.redundant_profile(self.planning.profile, hidden=self.redundant_hidden)
            self._redundant = pol.Planning(profile, self.policy)
        return self._redundant


@dataclass
class RunResult:
    """One policy on one trace: throughput, time breakdown, each recovery, a rate timeline."""

    policy: str
    horizon_s: float
    samples: float
    failure_free_throughput: float
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
            "failure_free_throughput": self.failure_free_throughput, "breakdown": self.breakdown,
            "recoveries": self.recoveries, "halted_at": self.halted_at,
        }


class _Run:
    """Mutable state of one simulated run."""

    def __init__(self, setup: Setup, name: str, horizon_s: float):
        self.name, self.horizon = name, horizon_s
        self.planning = setup.planning_for(name)
        self.plan: Plan | None = setup.plan
        self.t_step = self.planning.t_step(setup.plan)
        self.t_ff = setup.planning.t_step(setup.plan)
        self.batch_ff = setup.plan.global_batch
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
            batch = self.plan.global_batch
            useful = min(done, steps * batch * self.t_ff / self.batch_ff)
            self.samples += steps * batch
            self.acc["useful"] += useful
            self.acc["degraded"] += done - useful
            self.acc["lost"] += span - done
            self._mark(start, to, batch / self.t_step)
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


def simulate(setup: Setup, name: str, events: tuple[Event, ...], *, horizon_s: float, progress: bool = False) -> RunResult:
    """Run policy ``name`` over ``events`` for ``horizon_s`` seconds.

    Raises:
        ValueError: On an unknown policy name.
    """
    if name not in pol.SELECTOR_NAME and name != "torchft":
        raise ValueError(f"sim.policies: unknown policy {name!r}; use {', '.join([*pol.SELECTOR_NAME, 'torchft'])}")
    run = _Run(setup, name, horizon_s)
    tp = setup.plan.pipelines[0].stages[0].tp
    dead: set[int] = set()
    spares: list[tuple[int, ...]] = []
    dropped: list[Pipeline] = []
    fault_times: list[float] = []
    removals = [e.time_s for e in events if e.kind == "remove"]
    recoveries: list[dict] = []
    saves = _Saves(setup, run) if name == "checkpoint" else None
    for i, event in enumerate(tqdm(events, desc=name, disable=not progress, leave=False)):
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
            spares = [u for u in spares if not hit & set(u)]
            failed = hit & set(run.plan.devices) if run.plan is not None else set()
            if not failed:
                continue
            run.advance(event.time_s, abort=True)
            response = pol.on_fault(
                name, run.planning, run.plan, failed, policy=setup.policy, now_s=event.time_s,
                fault_times=fault_times[:-1], next_fault_s=d_true,
                checkpoint_age_s=saves.age(event.time_s) if saves else None,
            )
            if name == "torchft" and response.plan is not None:
                dropped += [p for p in run.plan.pipelines if failed & set(p.devices)]
            if response.rollback:
                saves.rollback()
            run.adopt(response)
            ratio = 0.0 if response.plan is None else (response.plan.global_batch / response.t_step) / (run.batch_ff / run.t_ff)
            recoveries.append({
                "time_s": event.time_s, "failed": sorted(failed), "choice": response.choice, "pause_s": response.pause_s,
                "t_step": response.t_step, "post_over_failure_free": ratio, "d_s": response.d_s,
            })
        else:
            back = set(event.devices) & dead
            dead -= back
            if run.plan is None or not back:
                continue
            run.advance(event.time_s, abort=False)
            if name == "torchft":
                response, dropped = pol.torchft_heal(run.planning, run.plan, dropped, dead)
            else:
                ids = sorted(back)
                spares += [tuple(ids[k:k + tp]) for k in range(0, len(ids) - len(ids) % tp, tp)]
                answer = pol.on_rejoin(
                    name, run.planning, run.plan, spares, policy=setup.policy, now_s=event.time_s,
                    fault_times=fault_times, next_fault_s=d_true,
                )
                response, spares = answer if answer else (None, spares)
            if response is not None:
                run.adopt(response)
    if saves:
        saves.until(horizon_s)
    run.advance(horizon_s, abort=False)
    return RunResult(name, horizon_s, run.samples, run.batch_ff / run.t_ff, run.acc, recoveries, run.timeline, run.halted_at)


class _Saves:
    """Checkpoint writes every Young/Daly interval ``sqrt(2·δ·MTBF)``, each pausing ``δ``."""

    def __init__(self, setup: Setup, run: _Run):
        self.run = run
        self.write_s = est.checkpoint_time(run.planning.profile, setup.plan.n_layers)
        self.interval_s = math.sqrt(2 * self.write_s * setup.mtbf_s)
        self.next_s = self.interval_s
        self.saved = (0.0, 0.0, dict(run.acc))  # (time, samples, breakdown) at the last checkpoint

    def until(self, t: float) -> None:
        """Write every checkpoint due before ``t``."""
        run = self.run
        while self.next_s < min(t, run.horizon) and run.plan is not None:
            run.advance(self.next_s, abort=False)
            self.saved = (run.now, run.samples, dict(run.acc))
            run.resume_at = max(run.resume_at, run.now) + self.write_s
            self.next_s = run.resume_at + self.interval_s

    def age(self, t: float) -> float:
        return t - self.saved[0]

    def rollback(self) -> None:
        """Discard the progress since the last checkpoint: its training time becomes lost."""
        run = self.run
        _, samples, acc = self.saved
        redone = sum(run.acc[k] - acc[k] for k in ("useful", "degraded"))
        run.samples = samples
        run.acc["useful"], run.acc["degraded"] = acc["useful"], acc["degraded"]
        run.acc["lost"] += redone
