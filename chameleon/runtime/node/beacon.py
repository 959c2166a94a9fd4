"""Where a worker is, shared with its node agent through a few words of shared memory.

A worker's main thread writes its position (generation, step, phase, detail, which
peer it waits on) and bumps a progress counter as it goes; its heartbeat thread bumps
a heartbeat counter. The agent on the same host reads them without any message:

- a heartbeat counter that stops means the process is not scheduled (SIGSTOP, a
  wedged interpreter): the worker is hung;
- a progress counter that stops while the position is not a wait on a peer or on
  the controller means the worker is alive but stuck (the progress watchdog);
- the position at the moment a worker dies says where the fault landed.
"""

from __future__ import annotations

from chameleon.runtime.protocol.position import NOBODY, PHASES, Position

_HEARTBEAT, _PROGRESS, _GENERATION, _STEP, _PHASE, _DETAIL, _WAITING = range(7)


class Beacon:
    """A worker's shared counters and position (see the module doc); created by the agent."""

    def __init__(self, words):
        self.words = words

    @classmethod
    def for_context(cls, ctx) -> Beacon:
        """A beacon in shared memory that ``ctx``'s processes (or the ``multiprocessing`` module's) can be given."""
        words = ctx.RawArray("q", 7)
        words[_WAITING], words[_DETAIL], words[_STEP] = NOBODY, -1, -1
        return cls(words)

    # ----- written by the worker --------------------------------------------------------

    def beat(self) -> None:
        self.words[_HEARTBEAT] += 1

    def at(self, phase: str, *, step: int | None = None, generation: int | None = None, detail: int = -1) -> None:
        """Enter ``phase`` (of ``step`` / ``generation`` when given); counts as progress."""
        w = self.words
        if generation is not None:
            w[_GENERATION] = generation
        if step is not None:
            w[_STEP] = step
        w[_PHASE] = PHASES.index(phase)
        w[_DETAIL] = detail
        w[_PROGRESS] += 1

    def waiting(self, on: int) -> None:
        """Mark a communication wait on device ``on`` (or GROUP); ``NOBODY`` ends it (progress)."""
        self.words[_WAITING] = on
        if on == NOBODY:
            self.words[_PROGRESS] += 1

    # ----- read by the agent ------------------------------------------------------------

    @property
    def heartbeat(self) -> int:
        return self.words[_HEARTBEAT]

    @property
    def progress(self) -> int:
        return self.words[_PROGRESS]

    def position(self) -> Position:
        w = self.words
        return Position(w[_GENERATION], w[_STEP], PHASES[w[_PHASE]], w[_DETAIL], w[_WAITING])
