"""What the user is told, as facts: effects of the core that only the recorder turns into lines on stderr
(:func:`chameleon.runtime.control.recorder.text_of`)."""

from __future__ import annotations

from dataclasses import dataclass

from chameleon.decision.selector import Decision
from chameleon.layout.plan import Plan
from chameleon.runtime.control.timelines import Growth, Recovery


class Notice:
    """A line (or a few) for the user."""


@dataclass(frozen=True)
class ConnectionRefused(Notice):
    why: str


@dataclass(frozen=True)
class Disagreed(Notice):
    """Replicas' digests disagreed before ``step``: the ``outvoted`` holders are lost devices."""

    step: int
    outvoted: tuple[int, ...]


@dataclass(frozen=True)
class NotFinite(Notice):
    """Step ``step`` was not finite: it is replayed (``corrupt``: the devices not finite before the sync)."""

    step: int
    loss: float
    grad_norm: float | None
    corrupt: tuple[int, ...]
    samples: tuple[int, int]


@dataclass(frozen=True)
class NotFiniteAgain(Notice):
    """Step ``step``'s replay was not finite on the same ``corrupt`` devices alone: they are evicted."""

    step: int
    loss: float
    grad_norm: float | None
    corrupt: tuple[int, ...]


@dataclass(frozen=True)
class ReplayedFinite(Notice):
    """The replay of ``step`` was finite: the ``suspects`` stay, or are ``evicted``."""

    step: int
    suspects: tuple[int, ...]
    evicted: bool


@dataclass(frozen=True)
class Preempting(Notice):
    """SIGTERM: a checkpoint is saved after ``step``, then the run stops."""

    step: int


@dataclass(frozen=True)
class CheckpointDamaged(Notice):
    """``device`` found the checkpoint it restores damaged; ``fallback``: the newest whole one's step (None: none)."""

    device: int
    why: str
    fallback: int | None


@dataclass(frozen=True)
class RecoveryDecided(Notice):
    """A recovery decided for ``devices`` lost at ``step`` (none: deciding again) onto ``plan``, from ``was``;
    ``reload_step``: the checkpoint it reloads, losing ``lost_s`` of progress."""

    devices: tuple[int, ...]
    step: int
    cause: str
    where: dict
    decision: Decision
    plan: Plan
    was: Plan
    reload_step: int | None = None
    lost_s: float = 0.0


@dataclass(frozen=True)
class Recovered(Notice):
    """A recovery's timeline, once its pace after it is known (or nothing more will be)."""

    recovery: Recovery


@dataclass(frozen=True)
class GrowthDeclined(Notice):
    devices: tuple[int, ...]
    decision: Decision


@dataclass(frozen=True)
class GrowingBack(Notice):
    devices: tuple[int, ...]
    decision: Decision
    plan: Plan
    was: Plan


@dataclass(frozen=True)
class Grew(Notice):
    growth: Growth


@dataclass(frozen=True)
class SlowDevices(Notice):
    """The verdict on slow devices changed after ``step``: each slow one's factor (none: all back to speed)."""

    step: int
    slow: dict[int, float]


@dataclass(frozen=True)
class Tolerating(Notice):
    decision: Decision


@dataclass(frozen=True)
class Reshaping(Notice):
    decision: Decision
    plan: Plan
    was: Plan
