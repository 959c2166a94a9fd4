"""Where a worker is in the run: its phases and :class:`Position`, as its beacon shows them to its agent
and its messages to the controller."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    """Phases a worker reports: ``standby`` waits for a generation, ``rebuild`` connects its groups,
    ``transfer`` moves state, ``ready`` waits for the generation to start, ``commit`` waits for the
    controller to commit the synced step, ``idle`` follows the commits of a step its plan gives it no part in,
    ``eval`` takes the validation loss before the step."""

    starting = "starting"
    standby = "standby"
    rebuild = "rebuild"
    transfer = "transfer"
    ready = "ready"
    forward = "forward"
    backward = "backward"
    sync = "sync"
    commit = "commit"
    optimizer = "optimizer"
    checkpoint = "checkpoint"
    done = "done"
    idle = "idle"
    eval = "eval"


PHASES = tuple(Phase)  # a beacon holds a phase as its index here

WAITING_ON_CONTROLLER = (Phase.starting, Phase.standby, Phase.ready, Phase.idle, Phase.commit, Phase.done)
"""Phases in which a worker only waits for the controller: never a stalled worker."""

NOBODY, GROUP = -1, -2  # ``waiting_on`` values: not in a communication wait; in a collective

@dataclass(frozen=True)
class Position:
    """A worker's place in the run, as its beacon last showed it."""

    generation: int
    step: int
    phase: Phase
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
