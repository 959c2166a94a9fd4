"""Which devices are in the job: one lifecycle per device, kept by the controller's core.

A device starts as a ``member``; a fault makes it ``lost``; when its node (or its restarted worker) returns it
is ``restarting`` until its worker is ready, then on ``standby`` — a candidate for growing — and a growth
makes it a ``member`` again. A fault of a returning device makes it ``lost`` once more.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from enum import StrEnum


class Lifecycle(StrEnum):
    member = "member"
    lost = "lost"
    restarting = "restarting"
    standby = "standby"


class Membership:
    """Every device's :class:`Lifecycle`, and since when each device on standby is back."""

    def __init__(self, devices: Iterable[int]):
        self._state = dict.fromkeys(devices, Lifecycle.member)
        self._in = {state: set() for state in Lifecycle}
        self._in[Lifecycle.member] = set(self._state)
        self._back: dict[int, float] = {}

    @property
    def members(self) -> Set[int]:
        """The devices in the job (the current generation's members are drawn from these); a view, not a copy."""
        return self._in[Lifecycle.member]

    def of(self, state: Lifecycle) -> set[int]:
        """The devices in ``state`` (a copy)."""
        return set(self._in[state])

    def is_member(self, device: int) -> bool:
        return self._state.get(device) == Lifecycle.member

    @property
    def standby(self) -> dict[int, float]:
        """The devices on standby, each with the wall time it came back."""
        return dict(self._back)

    def lose(self, devices: Iterable[int]) -> set[int]:
        """Mark ``devices`` lost (a returning one too); return those that were members."""
        was = {d for d in devices if self._state.get(d) == Lifecycle.member}
        for device in devices:
            self._move(device, Lifecycle.lost)
        return was

    def restart(self, devices: Iterable[int]) -> None:
        """A returning node is starting ``devices`` (those not in the job)."""
        for device in devices:
            if self._state.get(device) != Lifecycle.member:
                self._move(device, Lifecycle.restarting)

    def back(self, device: int, t: float) -> bool:
        """``device``'s worker is ready again at wall time ``t``: on standby. False when it is a member or on
        standby already (nothing changed)."""
        if self._state.get(device) in (Lifecycle.member, Lifecycle.standby):
            return False
        self._move(device, Lifecycle.standby)
        self._back[device] = t
        return True

    def join(self, devices: Iterable[int]) -> set[int]:
        """``devices`` are members from now on; return those that were not."""
        joined = {d for d in devices if self._state.get(d) != Lifecycle.member}
        for device in joined:
            self._move(device, Lifecycle.member)
        return joined

    def _move(self, device: int, state: Lifecycle) -> None:
        old = self._state.get(device)
        if old is not None:
            self._in[old].discard(device)
        self._state[device] = state
        self._in[state].add(device)
        if state != Lifecycle.standby:
            self._back.pop(device, None)
