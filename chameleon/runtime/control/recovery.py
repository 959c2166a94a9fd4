"""Recovering from a loss: the next generation decided in a thread of its own (the losses of one moment wait to be
decided as one; a later loss supersedes a decision under way: one decision for both), the recovery's timeline from
the fault to the first step committed after it, and its pace once steady."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from chameleon.decision.coordinator import NoRecovery, SavedState, Transition
from chameleon.layout.plan import Plan
from chameleon.report.breakdown import Span
from chameleon.runtime.control.background import Background
from chameleon.runtime.control.events import Record
from chameleon.runtime.control.notices import Recovered, RecoveryDecided
from chameleon.runtime.control.planning import Parcelling, Planning, Recover
from chameleon.runtime.control.timelines import Recovery
from chameleon.runtime.protocol.errors import TrainingError
from chameleon.runtime.protocol.messages import Parcels

PACE_STEPS = 3  # a recovery's estimate is compared with the median of this many steady steps after it


@dataclass(frozen=True)
class Loss:
    """What a recovery decides on: the devices lost (none: the same members, decided anew), why, the step it
    resumes at, and when the loss happened and was detected."""

    devices: frozenset[int]
    cause: str
    step: int
    t_fault: float
    t_detect: float
    source: str
    where: dict

    def then(self, later: Loss) -> Loss:
        """This loss and ``later``, which came while this one was being decided: one decision for both."""
        return replace(self, devices=self.devices | later.devices, cause=f"{self.cause}; then {later.cause}",
                       where={**self.where, **later.where})


class Recoverer:
    """The recovery under way (its timeline, from the loss to the first commit after it), the one being paced, and
    those done (see the module doc).

    Args:
        planning: runs the decisions (on a lane of their own).
        emit: takes the records and notices it makes.
    """

    def __init__(self, planning: Planning, emit: Callable[[object], None]):
        self.deciding = Background(planning)
        self.emit = emit
        self.timeline: Recovery | None = None
        self.pacing: tuple[Recovery, list[float]] | None = None  # a recovery closed, its steady steps being timed
        self.done: list[Recovery] = []
        self.told: list[object] = []  # a decision's record and notice, until its generation goes out
        self.waiting: Loss | None = None  # what the next decision is to be about, until it is submitted

    @property
    def busy(self) -> bool:
        """Whether a decision waits or is under way."""
        return self.waiting is not None or self.deciding.busy

    def lost(self, loss: Loss) -> None:
        """A loss: the recovery under way takes it in, or one begins; it waits (:attr:`waiting`) with the others of
        the same moment to be decided (a decision under way did not know of it: it is superseded, and the next
        decides for both)."""
        if self.pacing is not None:
            self._pace()  # a new fault: the last one's pace is what it was
        if self.timeline is None:
            self.timeline = Recovery(sorted(loss.devices), loss.cause, loss.step, loss.t_fault, loss.t_detect,
                                     loss.source, loss.where)
        else:
            self.timeline.failed = sorted(set(self.timeline.failed) | loss.devices)
            self.timeline.cause += f"; then {loss.cause} during recovery"
            self.timeline.where.update(loss.where)
        if self.waiting is None and self.deciding.busy:
            self.waiting = self.deciding.search.about
            self.deciding.cancel()
        self.waiting = loss if self.waiting is None else self.waiting.then(loss)

    def decide(self, resident: Plan, ahead: int | None, *, parcel: Parcelling, **kwargs) -> None:
        """Decide on the loss waiting on the decisions' lane (:class:`~chameleon.runtime.control.planning.Recover`,
        from the finished precompute ``ahead``), which encodes its moves too (``parcel``)."""
        loss, self.waiting = self.waiting, None
        self.deciding.submit(resident, loss, Recover(resident, ahead, parcel, kwargs))

    def cancel(self) -> None:
        """Nothing more decided (the end supersedes it)."""
        self.waiting = None
        self.deciding.cancel()

    def decided(self, now: float, *, generation: int, was: Plan,
                saved: SavedState | None) -> tuple[Transition, Parcels | None] | None:
        """The decision and its encoded moves, once the thread has them (None before); ``generation``: the broken
        one. It is recorded and told once :meth:`published` (the next generation goes out first).

        Raises:
            TrainingError: no recovery is possible.
        """
        search = self.deciding.finished()
        if search is None:
            return None
        loss: Loss = search.about
        try:
            transition, parcels = search.future.result()
        except NoRecovery as err:
            raise TrainingError(str(err)) from None
        rec = self.timeline
        rec.t_decided, rec.decision = now, transition.decision
        rec.estimated_step_s = transition.estimated_step_s
        if transition.manifest is not None:
            rec.manifest_bytes, rec.manifest_rounds = transition.manifest.wire_bytes, len(transition.manifest.round_bytes)
        self.told = [Record({
            "event": "fault", "generation": generation, "failed_ranks": sorted(loss.devices), "cause": loss.cause,
            "step": loss.step, "where": loss.where, "t_fault": loss.t_fault, "t_fault_source": loss.source,
            "detect_s": loss.t_detect - loss.t_fault, "decide_s": rec.t_decided - loss.t_detect,
            "decision": rec.decision.to_dict(), "manifest_bytes": rec.manifest_bytes,
            "manifest_rounds": rec.manifest_rounds,
        })]
        reload = (transition.resume_step, loss.t_detect - saved.committed_at) if transition.checkpoint else (None, 0.0)
        self.told.append(RecoveryDecided(tuple(sorted(loss.devices)), loss.step, loss.cause, loss.where,
                                         transition.decision, transition.plan, was, *reload))
        return transition, parcels

    def published(self, now: float) -> None:
        """The decision's generation went out: recorded and told now (at 8,192 devices, writing a decision's record
        took a tenth of a second of the loop, which the generation no longer waits for)."""
        self.timeline.t_published = now
        for effect in self.told:
            self.emit(effect)
        self.told = []

    def started(self, now: float) -> None:
        if self.timeline is not None:
            self.timeline.t_started = now

    def paced(self, step_s: float | None, *, finished: bool) -> None:
        """A step committed (``step_s``: its time, if steady): the closed recovery is told once ``PACE_STEPS`` steady
        steps followed it, or the last step."""
        if self.pacing is None:
            return
        if step_s is not None:
            self.pacing[1].append(step_s)
        if len(self.pacing[1]) >= PACE_STEPS or finished:
            self._pace()

    def committed(self, now: float, step_s: float | None, *, generation: int, finished: bool) -> list[Span]:
        """The first commit after the loss (``step_s``: its compute), or the last validation redone (None), closes
        the recovery: its detection, decision and restore are returned; its pace is timed from here."""
        rec = self.timeline
        if rec is None:
            return []
        self.timeline, rec.t_first_commit, rec.first_step_s = None, now, step_s
        self.done.append(rec)
        self.emit(Record({"event": "recovered", "generation": generation, "time": now, **rec.record()}))
        self.pacing = rec, []
        if step_s is None or finished:
            self._pace()
        return [("detection", rec.t_fault, rec.t_detect), ("decision", rec.t_detect, rec.t_decided),
                ("restore", rec.t_decided, rec.t_started)]

    def _pace(self) -> None:
        """The recovery told, its estimate compared with the median of the steady steps after warm-up, not with the
        first (restore, warm-up)."""
        (rec, times), self.pacing = self.pacing, None
        if times:
            rec.steady_step_s = sorted(times)[len(times) // 2]
        self.emit(Recovered(rec))
