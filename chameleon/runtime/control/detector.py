"""Fault detection from silence: lapsed node leases, and workers that stopped making progress.

Process exits and stopped heartbeats are seen by each node's agent, which reports
them; what only the controller can see is here. A node whose agent sent nothing
within ``lease_timeout_s`` is lost (the agent fences its own workers): every message
a node sends renews its lease, and an agent with nothing to say sends a lease. Silence
is measured up to the moment the controller last read every link, so time the
controller itself spent elsewhere (a long decision, a stall) is no node's silence. And
when no step commits for longer than the progress bound, the watchdog asks every
agent where its workers are (each answers with every worker's position and how
long its progress counter has stood still, measured on its node); a device that
has not reported the open step and whose counter stood still for the whole bound
while it was neither waiting on a peer nor on the controller is stuck — alive,
heartbeating, not progressing — and is fenced like a hung one.
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon.runtime.protocol.position import NOBODY, WAITING_ON_CONTROLLER, Position


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
    """Leases of remote nodes and the stall verdict over reported positions (see the module doc)."""

    def __init__(self, *, lease_timeout_s: float, start_timeout_s: float):
        self.lease_timeout_s, self.start_timeout_s = lease_timeout_s, start_timeout_s
        self.leases: dict[int, float] = {}  # node → when it was last heard from
        self.starting: dict[int, float] = {}  # node → when the job took it on; not heard from since

    def renewed(self, node: int, now: float) -> None:
        """``node`` was heard from: a starting node's lease begins now."""
        if node in self.leases or self.starting.pop(node, None) is not None:
            self.leases[node] = now

    def watch(self, node: int, now: float) -> None:
        """Hold ``node`` to its lease from the first time it is heard from after ``now``, when the job took it
        on (at the job's start, or its return to a running job): a starting host is not a lost one, but one
        not heard from within ``start_timeout_s`` is."""
        self.starting[node] = now

    def forget(self, node: int) -> None:
        self.leases.pop(node, None)
        self.starting.pop(node, None)

    def lapsed(self, heard_at: float) -> dict[int, float]:
        """Nodes whose lease was not renewed in time, or that were never heard from after they were taken on,
        with how long each was silent, as of ``heard_at``: when the controller last read every link (what a
        node sent before then has been seen)."""
        late = {n: heard_at - t for n, t in self.leases.items() if heard_at - t > self.lease_timeout_s}
        return late | {n: heard_at - t for n, t in self.starting.items() if heard_at - t > self.start_timeout_s}


def stall(silent: set[int], positions: dict[int, tuple[Position, float]], *, bound_s: float) -> Stall:
    """Which of the ``silent`` devices are stuck on their own: not waiting, no progress for ``bound_s``.

    ``positions``: each device's position and how long its progress counter has stood still.
    """
    stuck, suspects = [], []
    for device in sorted(silent):
        if device not in positions:
            continue
        position, quiet_s = positions[device]
        if position.waiting_on != NOBODY or position.phase in WAITING_ON_CONTROLLER:
            continue
        (stuck if quiet_s > bound_s else suspects).append(device)
    return Stall(tuple(stuck), tuple(suspects), {d: positions[d][0] if d in positions else None for d in silent})
