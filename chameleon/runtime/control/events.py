"""What the controller's core is told and what it asks for: events in, effects out (:meth:`Core.handle`).

Events: a node registered (:class:`Registered`), a node's message (:class:`Received`), a node's link lost
(:class:`Lost`), a refused connection (:class:`Refused`), a tick (:class:`Tick`), a SIGTERM (:class:`Preempt`).
Effects: messages to one node (:class:`Send`) or every node (:class:`Broadcast`, encoded once), a registering
agent admitted (:class:`Admit`) or refused (:class:`Refuse`), a link to close (:class:`Close`), what the run
recorder alone writes (:class:`Record`, :class:`Committed`, :class:`Validated` and the
:mod:`~chameleon.runtime.control.notices`), a checkpoint to commit (:class:`SaveCheckpoint`) or set aside
(:class:`SetAside`), faults to remember as fired (:class:`Fired`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chameleon.faults.spec import FaultSpec
from chameleon.runtime.control.ledger import CheckpointComplete
from chameleon.runtime.protocol.messages import Hello, Welcome

# ----- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Registered:
    """A node's agent proved the secret and said hello."""

    hello: Hello


@dataclass(frozen=True)
class Received:
    """A message from node ``node``'s agent (in-process on node 0)."""

    node: int
    message: object


@dataclass(frozen=True)
class Lost:
    """Node ``node``'s link closed or failed verification."""

    node: int
    cause: str


@dataclass(frozen=True)
class Refused:
    """A connection that could not prove the secret."""

    why: str


@dataclass(frozen=True)
class Tick:
    """Time passed (leases, the watchdog, timed faults, growth).

    ``heard_at``: when the controller last read every link (monotonic; None: now). Leases are judged on the
    silence up to then, never on time the controller itself spent between that reading and this tick.
    """

    heard_at: float | None = None


@dataclass(frozen=True)
class Idle:
    """Every event at hand was handled: the edge read what was ready and carried out what followed (a broadcast
    that found more links broken included). Losses of one moment are decided as one from here (a rack that fails
    at once is one decision, not one per node, each superseding the last)."""


@dataclass(frozen=True)
class Preempt:
    """SIGTERM: save a checkpoint at the next step boundary, then stop."""


# ----- effects ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """A message to one node; ``payload``: its frame, when encoded already (off the event loop)."""

    node: int
    message: object
    payload: bytes | None = None


@dataclass(frozen=True)
class Admit:
    """Bind the registering agent's link to ``node`` and welcome it (the same node again: a return)."""

    node: int
    welcome: Welcome | None  # None for node 0's agent, in the controller's own process


@dataclass(frozen=True)
class Refuse:
    """Answer the registering agent's link with ``why`` and close it."""

    why: str


@dataclass(frozen=True)
class Broadcast:
    """The same message to every node (encoded once)."""

    message: object


@dataclass(frozen=True)
class Close:
    """Drop node ``node``'s link (its agent, if alive, finds its lease lapsed and fences its workers)."""

    node: int


@dataclass(frozen=True)
class Record:
    """A line of ``events.jsonl``."""

    event: dict


@dataclass(frozen=True)
class Committed:
    """A committed step, for ``metrics.jsonl``, the progress bar and the summary."""

    step: int
    loss: float
    samples: tuple[int, int]
    step_time_s: float
    compute_s: float
    grad_norm: float | None
    lr: float
    generation: int
    time: float
    commit_s: float  # the commit's publication after the slowest trainer synced (clocks of one host)
    val_loss: float | None = None  # the validation loss of the parameters this step trained from, where taken


@dataclass(frozen=True)
class Validated:
    """The validation loss before ``step`` (``step == train.steps``: after the last), for the recorder."""

    step: int
    loss: float
    generation: int
    time: float


@dataclass(frozen=True)
class SaveCheckpoint:
    """Every writer saved its part: commit the checkpoint on disk."""

    complete: CheckpointComplete


@dataclass(frozen=True)
class SetAside:
    """A checkpoint found damaged: move it out of the way of readers and of its step's next save."""

    root: Path
    step: int


@dataclass(frozen=True)
class Fired:
    """Faults fired so far: remembered in the checkpoint root, so a relaunch never fires them again."""

    faults: tuple[FaultSpec, ...]
