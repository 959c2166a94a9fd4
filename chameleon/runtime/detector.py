"""Fault detection from silence: lapsed node leases, and workers that stopped making progress.

Process exits and stopped heartbeats are seen by each node's agent, which reports
them; what only the controller can see is here. A remote node whose lease is not
renewed within ``lease_timeout_s`` is lost (its agent fences its own workers). And
when no step commits for longer than the progress bound, the watchdog looks at
every device that has not reported: one whose progress counter stood still while it
was neither waiting on a peer nor on the controller is stuck — alive, heartbeating,
not progressing — and is fenced like a hung one.
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon.runtime.beacon import NOBODY, WAITING_ON_CONTROLLER, Position


@dataclass
class _Seen:
    position: Position
    progress: int
    changed_at: float


@dataclass(frozen=True)
class Stall:
    """What the watchdog found: devices stuck on their own for the whole bound, devices neither waiting
    nor progressing for less (suspects, not yet proven), and where every silent device is."""

    stuck: tuple[int, ...]
    suspects: tuple[int, ...]
    silent: dict[int, Position | None]

    def describe(self) -> str:
        return "; ".join(f"device {d}: " + (p.describe() if p else "no position reported")
                         for d, p in sorted(self.silent.items()))


class Detector:
    """Leases of remote nodes and the progress of every device (see the module doc)."""

    def __init__(self, *, lease_timeout_s: float):
        self.lease_timeout_s = lease_timeout_s
        self.leases: dict[int, float] = {}
        self.seen: dict[int, _Seen] = {}

    def renewed(self, node: int, now: float) -> None:
        self.leases[node] = now

    def forget(self, node: int) -> None:
        self.leases.pop(node, None)

    def lapsed(self, now: float) -> list[int]:
        """Nodes whose lease was not renewed in time."""
        return [n for n, t in self.leases.items() if now - t > self.lease_timeout_s]

    def observe(self, positions: dict[int, tuple[Position, int]], now: float) -> None:
        """Record devices' positions and progress counters (from a lease, or the local agent)."""
        for device, (position, progress) in positions.items():
            seen = self.seen.get(device)
            if seen is None or seen.progress != progress:
                self.seen[device] = _Seen(position, progress, now)
            else:
                seen.position = position

    def position(self, device: int) -> Position | None:
        seen = self.seen.get(device)
        return seen.position if seen else None

    def stall(self, silent: set[int], *, now: float, bound_s: float) -> Stall:
        """Which of the ``silent`` devices are stuck on their own: not waiting, no progress for ``bound_s``."""
        stuck, suspects = [], []
        for device in sorted(silent):
            seen = self.seen.get(device)
            if seen is None or seen.position.waiting_on != NOBODY or seen.position.phase in WAITING_ON_CONTROLLER:
                continue
            (stuck if now - seen.changed_at > bound_s else suspects).append(device)
        return Stall(tuple(stuck), tuple(suspects), {d: self.position(d) for d in silent})
