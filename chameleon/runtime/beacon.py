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

from dataclasses import dataclass

PHASES = (
    "starting", "standby", "rebuild", "transfer", "ready", "forward", "backward", "sync", "commit", "optimizer",
    "checkpoint", "done", "idle", "eval",
)
"""Phases a worker reports: ``standby`` waits for a generation, ``rebuild`` connects its groups,
``transfer`` moves state, ``ready`` waits for the generation to start, ``commit`` waits for the
controller to commit the synced step, ``idle`` follows the commits of a step its plan gives it no part in,
``eval`` takes the validation loss before the step."""

WAITING_ON_CONTROLLER = ("starting", "standby", "ready", "idle", "commit", "done")
"""Phases in which a worker only waits for the controller: never a stalled worker."""

NOBODY, GROUP = -1, -2  # ``waiting_on`` values: not in a communication wait; in a collective

_HEARTBEAT, _PROGRESS, _GENERATION, _STEP, _PHASE, _DETAIL, _WAITING = range(7)


@dataclass(frozen=True)
class Position:
    """A worker's place in the run, as its beacon last showed it."""

    generation: int
    step: int
    phase: str
    detail: int = -1  # micro-batch of a forward/backward, round of a transfer or sync
    waiting_on: int = NOBODY  # peer device of a point-to-point wait, GROUP in a collective

    def describe(self) -> str:
        """E.g. ``step 5, backward of micro-batch 2 (generation 1)``."""
        what = {"forward": "micro-batch", "backward": "micro-batch", "transfer": "round", "sync": "round",
                "eval": "batch"}.get(self.phase)
        phase = f"{self.phase} of {what} {self.detail}" if what and self.detail >= 0 else self.phase
        if self.waiting_on >= 0:
            phase += f", waiting on device {self.waiting_on}"
        elif self.waiting_on == GROUP:
            phase += ", in a collective"
        return f"step {self.step}, {phase} (generation {self.generation})"

    def to_dict(self) -> dict:
        return {"generation": self.generation, "step": self.step, "phase": self.phase, "detail": self.detail,
                "waiting_on": self.waiting_on, "where": self.describe()}


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
