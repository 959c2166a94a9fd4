"""Growing back onto returned devices: whether it pays is decided in the planner's thread (in the decisions', back
onto a plan that ran while the planner still precomputes); a growth that pays
switches at the next step boundary, and its timeline closes at the first commit on the grown plan."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from chameleon.decision.coordinator import Transition
from chameleon.decision.selector import Decision
from chameleon.layout.plan import Plan
from chameleon.report.breakdown import Span
from chameleon.runtime.control.background import Background
from chameleon.runtime.control.events import Record
from chameleon.runtime.control.notices import GrowingBack, Grew, GrowthDeclined
from chameleon.runtime.control.planning import Grow, GrowAhead, Parcelling, Planning
from chameleon.runtime.control.timelines import Growth
from chameleon.runtime.protocol.messages import Parcels

GROW_SETTLE_S = 0.5  # wait for more returning devices this long after the last one


class Grower:
    """Growths: the one being decided, the devices last found not worth it, the one switching, those done.

    Args:
        planning: runs the decisions (on the planner's lane).
        emit: takes the records and notices it makes.
    """

    def __init__(self, planning: Planning, emit: Callable[[object], None]):
        self.background = Background(planning)
        self.readying = Background(planning)  # the growth onto every device out of the job, decided ahead
        self.emit = emit
        self.declined: frozenset[int] = frozenset()  # the devices back when growing last did not pay
        self.timeline: Growth | None = None  # a growth decided, until its first commit
        self.done: list[Growth] = []

    def consider(self, standby: Mapping[int, float], *, restarting: bool, now: float, resident: Plan,
                 ahead: int | None, ready: bool, parcel: Parcelling, context: Callable[[], dict]) -> None:
        """Devices on ``standby`` (since when each is back): decide on growing ``resident`` onto them with
        ``context()`` (:class:`~chameleon.runtime.control.planning.Grow`; a growth's moves encoded there too, by
        ``parcel``), once no device is ``restarting`` or the last came back ``GROW_SETTLE_S`` ago: from the
        precompute ``ahead`` on the planner's lane, or — the precompute not ``ready`` and a plan having run on
        exactly the devices the growth would use (``context()["measured"]``) — from that plan, on the decisions'
        lane, without waiting."""
        joining = frozenset(standby)
        if not joining or joining == self.declined or self.background.busy:
            return
        if restarting and now - max(standby.values()) < GROW_SETTLE_S:
            return  # a node's devices come back together: wait a moment for the rest
        kwargs = {"joining": set(joining), **context()}
        ran = None if ready else kwargs["measured"].ran_on(set(resident.devices) | joining | kwargs["alive"])
        if ran is not None:
            self.readying.cancel()  # decided without it: whatever it would build is not this growth's
        self.background.submit(resident, joining, Grow(resident, ahead, parcel, kwargs, ran))

    def ready(self, out: set[int], *, resident: Plan, ahead: int, parcel: Parcelling,
              context: Callable[[], dict]) -> None:
        """Devices ``out`` of the job (lost, restarting, on standby) while ``resident`` starts: decide now, after the
        precompute ``ahead``, the growth :meth:`consider` will ask for once they are all back, so that its manifest and
        encoded moves are built by then (:class:`~chameleon.runtime.control.planning.GrowAhead`)."""
        self.readying.cancel()
        if out:
            self.readying.submit(resident, frozenset(out), GrowAhead(resident, ahead, parcel,
                                                                      {"joining": set(out), **context()}))

    def ripe(self, resident: Plan, standby: Mapping[int, float],
             now: float) -> tuple[Transition, Parcels | None] | None:
        """A decided growth and its encoded moves, if it is ready and still stands (same plan, same devices back)."""
        growth = self.background.finished()
        if growth is None:
            return None
        joining = growth.about
        if not growth.stands(resident) or not joining <= set(standby):
            return None
        outcome, parcels = growth.future.result()
        t_back = min(standby[d] for d in joining)
        if isinstance(outcome, Decision):
            self.declined = joining
            self.emit(Record({"event": "growth", "devices": sorted(joining), "choice": outcome.choice,
                              "decision": outcome.to_dict()}))
            self.emit(GrowthDeclined(tuple(sorted(joining)), outcome))
            return None
        self.timeline = Growth(sorted(joining), t_back, t_decided=now, decision=outcome.decision,
                               plan=outcome.plan.describe(), estimated_step_s=outcome.estimated_step_s,
                               manifest_bytes=outcome.manifest.wire_bytes if outcome.manifest else 0)
        return outcome, parcels

    def switched(self, grown: Transition, joined: set[int], was: Plan, now: float) -> None:
        """The grown generation is published: ``joined`` are members from now on."""
        self.timeline.t_switch = now
        self.emit(GrowingBack(tuple(sorted(joined)), grown.decision, grown.plan, was))

    def started(self, now: float) -> None:
        if self.timeline is not None:
            self.timeline.t_started = now

    def committed(self, now: float, generation: int) -> list[Span]:
        """A step committed: the first on the grown plan closes the growth (its restore is returned)."""
        g = self.timeline
        if g is None or not g.t_started:
            return []
        self.timeline, g.t_first_commit = None, now
        self.done.append(g)
        self.emit(Record({"event": "grown", "generation": generation, "time": now, **g.record()}))
        self.emit(Grew(g))
        return [("restore", g.t_switch, g.t_started)]

    def cancel(self) -> None:
        """A fault supersedes the growth (a search under way finishes unheard)."""
        self.timeline = None
        self.background.cancel()
        self.readying.cancel()
