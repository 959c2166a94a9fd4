"""Training around slow devices: each steady step's pace judges every device (:class:`Stragglers`); a changed
verdict is decided on in the planner's thread (Eq. 8: tolerate, rebalance, replan or evict); a move to a new
plan switches at the next step boundary, and no new decision comes before it paid its transition. Every device
back to speed is decided on only where the plan moved around slow ones: otherwise there is nothing to undo, and a
blip found slow (a busy host) never re-plans a healthy job."""

from __future__ import annotations

import math
from collections.abc import Callable

from chameleon.config import FaultToleranceConfig, SlowPolicy
from chameleon.decision.coordinator import Transition
from chameleon.decision.estimator import device_work
from chameleon.decision.profiler import Profile
from chameleon.decision.selector import Decision
from chameleon.layout.plan import Plan
from chameleon.report.breakdown import Span
from chameleon.runtime.control.background import Background
from chameleon.runtime.control.events import Record
from chameleon.runtime.control.notices import Reshaping, SlowDevices, Tolerating
from chameleon.runtime.control.planning import Parcelling, Planning, Reshape as ReshapeRequest
from chameleon.runtime.control.stragglers import Stragglers
from chameleon.runtime.control.timelines import Reshape
from chameleon.runtime.protocol.messages import Parcels


def _slow(speeds: dict[int, float]) -> dict[str, float]:
    return {str(d): f for d, f in sorted(speeds.items())}


class Reshaper:
    """The verdict on slow devices and the decisions on it (see the module doc).

    Args:
        ft: ``ft.slow`` (off: no device is ever judged), its ratio, window and horizon.
        planning: runs the decisions (on the planner's lane).
        emit: takes the records and notices it makes.
    """

    def __init__(self, ft: FaultToleranceConfig, planning: Planning, emit: Callable[[object], None]):
        self.ft, self.emit = ft, emit
        self.stragglers = Stragglers(ratio=ft.slow_ratio, window=ft.slow_window) if ft.slow == SlowPolicy.on else None
        self.background = Background(planning)
        self.work: dict[int, float] = {}  # each trainer's compute per step under the resident plan, as modelled
        self.roles: dict[int, tuple[int, int]] = {}  # each trainer's layers under the resident plan
        self.self_timed: dict[int, float] = {}  # idle members' slowdowns reported since the last commit
        self.due = False  # the verdict on slow devices changed since the last decision on it
        self.around = False  # the resident plan was chosen knowing of slow devices (a move back may pay)
        self.after = 0  # no decision on slow devices before this step: the last one stands its cost's worth
        self.timeline: Reshape | None = None  # a decision under way, then its switch, until its first commit
        self.done: list[Reshape] = []

    @property
    def slow(self) -> dict[int, float]:
        """The devices judged slow, with their factors."""
        return dict(self.stragglers.slow) if self.stragglers is not None else {}

    def resident(self, profile: Profile, plan: Plan) -> None:
        """A generation started on ``plan``: its trainers' work and roles; paces are judged afresh."""
        self.around = bool(self.slow)
        self.work = device_work(profile, plan)
        self.roles = {d: st.layers for p in plan.pipelines for st in p.stages for d in st.devices}
        if self.stragglers is not None:
            self.stragglers.restart()

    def timed(self, device: int, slowdown: float) -> None:
        """An idle member's self-test."""
        self.self_timed[device] = slowdown

    def judge(self, step: int, busy: tuple[tuple[int, float], ...], now: float) -> None:
        """A steady step's compute of every trainer (and the idle members' self-tests since the last): a device
        found slow, or back, is decided on (:meth:`consider`)."""
        if self.stragglers is None:
            return
        pace = {d: s / self.work[d] for d, s in busy if self.work.get(d, 0.0) > 0 and s > 0}
        seen = self.stragglers.slowdowns(pace, self.roles) | self.self_timed
        self.self_timed = {}
        if self.stragglers.observe(seen):
            self.due = self._undecided()
            slow = dict(self.stragglers.slow)
            self.emit(Record({"event": "slow", "step": step, "slow": _slow(slow), "time": now}))
            self.emit(SlowDevices(step, slow))

    def _undecided(self) -> bool:
        """Whether the verdict now asks for a decision: some device is slow, or all are back on a plan chosen knowing
        of slow ones."""
        return bool(self.slow) or self.around

    def forget(self, devices: set[int]) -> None:
        """Lost devices: no longer judged; what is still slow is decided afresh on the plan the recovery brings."""
        if self.stragglers is not None:
            self.stragglers.forget(devices)
            self.due = bool(self.stragglers.slow)

    def consider(self, resident: Plan, *, next_step: int, times: list[float], now: float,
                 parcel: Parcelling, context: Callable[[], dict]) -> None:
        """A changed verdict: decide on ``resident`` with ``speeds``, ``step_s``, ``horizon_s`` and ``context()`` on
        the planner's lane (:meth:`~chameleon.decision.coordinator.Coordinator.reshape`; a new plan's moves encoded
        there too, by ``parcel``), from the median of the resident plan's last steady step ``times``."""
        if not self.due or self.background.busy or next_step < self.after or not times:
            return
        self.due = False
        speeds = self.slow
        recent = sorted(times[-self.ft.slow_window:])
        self.background.submit(resident, tuple(sorted(speeds.items())), ReshapeRequest(resident, parcel, {
            "speeds": speeds, "step_s": recent[len(recent) // 2], "horizon_s": self.ft.slow_expected_s, **context()}))
        self.timeline = Reshape(speeds, next_step, now)

    def ripe(self, resident: Plan, now: float) -> tuple[Transition, Parcels | None] | None:
        """A decided reshape that moves to a new plan, and its encoded moves, if it is ready and still stands (same
        plan, same verdict)."""
        search = self.background.finished()
        if search is None:
            return None
        timeline = self.timeline
        if not search.stands(resident) or search.about != tuple(sorted(self.slow.items())):
            self.timeline, self.due = None, self._undecided()
            return None
        outcome, parcels = search.future.result()
        timeline.t_decided = now
        decision = outcome if isinstance(outcome, Decision) else outcome.decision
        timeline.decision = decision
        self.emit(Record({"event": "reshape", "step": timeline.step, "slow": _slow(timeline.speeds),
                          "decision": decision.to_dict(), "time": now}))
        if isinstance(outcome, Decision):
            self.timeline = None
            self.done.append(timeline)
            self.emit(Tolerating(decision))
            return None
        timeline.plan, timeline.estimated_step_s = outcome.plan.describe(), outcome.estimated_step_s
        return outcome, parcels

    def switched(self, to: Transition, was: Plan, *, next_step: int, now: float) -> None:
        """The generation chosen is published; no new decision on slow devices before it paid its transition."""
        self.timeline.t_switch = now
        chosen = to.decision.chosen
        self.after = next_step + max(self.ft.slow_window, math.ceil(chosen.transition / max(chosen.t_step, 1e-9)))
        self.emit(Reshaping(to.decision, to.plan, was))

    def started(self, now: float) -> None:
        if self.timeline is not None and self.timeline.t_switch:
            self.timeline.t_started = now

    def committed(self, now: float, step_s: float, generation: int) -> list[Span]:
        """A step committed: the first on the plan chosen closes the reshape (its restore is returned)."""
        r = self.timeline
        if r is None or not r.t_started:
            return []
        self.timeline = None
        r.t_first_commit, r.first_step_s = now, step_s
        self.done.append(r)
        self.emit(Record({"event": "reshaped", "generation": generation, "time": now, **r.record()}))
        return [("restore", r.t_switch, r.t_started)]

    def cancel(self) -> None:
        """A fault supersedes the decision or switch under way (a search under way finishes unheard)."""
        self.timeline = None
        self.background.cancel()
