"""The progress watchdog: when no step commits within the progress bound, it asks every node where its devices
are (a :class:`~chameleon.runtime.protocol.messages.Probe`), then names the devices stuck on their own
(:func:`~chameleon.runtime.control.detector.stall`), or stops the run naming the silent ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from chameleon.config import FaultToleranceConfig
from chameleon.runtime.control.detector import stall
from chameleon.runtime.protocol.errors import TrainingError
from chameleon.runtime.protocol.messages import Positions, Probe
from chameleon.runtime.protocol.position import Position

PROBE_WAIT_S = 1.0  # the watchdog decides with the answers it has by then


@dataclass
class _Probe:
    id: int
    sent: float
    answers: dict[int, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class Stuck:
    """Devices stuck on their own for the whole bound, where each is, and for how long nothing progressed."""

    devices: set[int]
    where: dict[int, Position | None]
    quiet_s: float


class Watchdog:
    """The progress bound and the probe under way (see the module doc); times are the core's monotonic ones.

    Args:
        ft: the bound's settings (``ft.stall_*``).
        floor_s: the least bound until a generation started, and throughout under ``compile``
            (``launcher.timeout_s``: the backend's own timeout bounds every wait meanwhile).
        compile: ``train.compile``: a device meeting a new stage shape compiles for a while.
        now: when it starts watching.
    """

    def __init__(self, ft: FaultToleranceConfig, *, floor_s: float, compile: bool, now: float):
        self.ft, self.floor_s, self.compile = ft, floor_s, compile
        self.last_progress = now
        self.step_times: dict[int, float] = {}
        self.probe: _Probe | None = None
        self.probes = 0

    def progressed(self, now: float) -> None:
        self.last_progress = now

    def committed(self, step: int, step_s: float, now: float) -> None:
        self.step_times[step] = step_s
        self.last_progress = now

    def bound(self, estimate: Callable[[], float], *, started: bool) -> float:
        """How long the job may go without progress: ``ft.stall_timeout_s``, else derived from the step time (the
        estimator's, ``estimate``, or the recent median where longer); at least ``floor_s`` until ``started``."""
        bound = self.ft.stall_timeout_s
        if bound is None:
            expected = estimate()
            if self.step_times:
                recent = sorted(list(self.step_times.values())[-20:])
                expected = max(expected, recent[len(recent) // 2])
            bound = max(self.ft.stall_min_s, self.ft.stall_factor * expected)
        return bound if started and not self.compile else max(bound, self.floor_s)

    def answered(self, node: int, msg: Positions) -> None:
        if self.probe is not None and msg.probe == self.probe.id:
            self.probe.answers[node] = msg.positions

    def check(self, now: float, *, bound: float, watching: bool, generation: int, nodes: int,
              silent: Callable[[], set[int]]) -> Probe | Stuck | None:
        """The probe to send, or the devices stuck, once no progress for ``bound`` while ``watching``; decided
        when all ``nodes`` answered or ``PROBE_WAIT_S`` passed, over the members that have not reported (``silent``).

        Raises:
            TrainingError: no device is stuck on its own, and none may be soon.
        """
        quiet = now - self.last_progress
        if not watching or quiet <= bound:
            self.probe = None
            return None
        if self.probe is None:
            self.probes += 1
            self.probe = _Probe(self.probes, now)
            return Probe(generation, self.probe.id)
        if len(self.probe.answers) < nodes and now - self.probe.sent < PROBE_WAIT_S:
            return None
        answers, self.probe = self.probe.answers, None
        positions = {d: p for per_node in answers.values() for d, p in per_node.items()}
        found = stall(silent(), positions, bound_s=bound)
        if found.stuck:
            return Stuck(set(found.stuck), {d: found.silent[d] for d in found.stuck}, quiet)
        if found.suspects:  # still for less than the bound so far: proven stuck, or moving again, soon
            return None
        raise TrainingError(
            f"no step committed for {quiet:.0f} s (bound {bound:.0f} s) and no device is stuck on its own; "
            f"devices that have not reported: {found.describe() or 'none'}"
        )
