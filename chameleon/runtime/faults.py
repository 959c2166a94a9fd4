"""Fault injection (Hydra group ``failure``): real SIGKILLs and SIGSTOPs of worker processes.

A fault pinned to a phase of a step (forward, backward, sync, optimizer, or the
recovery that follows an earlier fault) is fired by the victim itself at that exact
point — ``os.kill(getpid(), SIGKILL)`` ends it as abruptly as a lost device. A
fault at ``phase=any``, a hang (SIGSTOP) and a fault at a wall-clock time are
fired by the controller from outside.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

WORKER_PHASES = ("forward", "backward", "sync", "optimizer", "recovery")
PHASES = WORKER_PHASES + ("any",)
KINDS = ("none", "kill", "hang", "schedule", "random")


@dataclass
class FaultSpec:
    """One injected fault: ``kill`` (SIGKILL) or ``hang`` (SIGSTOP) of device ``rank``.

    Pinned to ``step`` and ``phase``, or to ``at_s`` seconds after training starts.
    """

    kind: str = "kill"
    rank: int = 1
    step: int | None = None
    phase: str = "any"
    at_s: float | None = None


@dataclass
class FailureConfig:
    kind: str = "none"  # none | kill | hang | schedule | random
    rank: int = 1
    step: int = 5
    phase: str = "any"  # forward | backward | sync | optimizer | recovery | any
    faults: list[FaultSpec] = field(default_factory=list)  # kind=schedule
    mtbf_s: float = 30.0  # kind=random: mean time between faults over the whole job
    max_faults: int = 1  # kind=random
    seed: int = 0


def planned_faults(cfg: dict, *, world: int) -> list[FaultSpec]:
    """The faults a ``failure`` config asks for, validated.

    Raises:
        ValueError: naming the ``failure.*`` key and the fix.
    """
    kind = cfg["kind"]
    if kind not in KINDS:
        raise ValueError(f"failure.kind={kind!r}: use one of {', '.join(KINDS)}")
    if kind == "none":
        return []
    if kind in ("kill", "hang"):
        faults = [FaultSpec(kind=kind, rank=cfg["rank"], step=cfg["step"], phase=cfg["phase"])]
    elif kind == "schedule":
        faults = [FaultSpec(**f) for f in cfg["faults"]]
    else:
        rng = random.Random(cfg["seed"])
        at, faults = 0.0, []
        for _ in range(cfg["max_faults"]):
            at += rng.expovariate(1.0 / cfg["mtbf_s"])
            faults.append(FaultSpec(kind="kill", rank=rng.randrange(world), at_s=round(at, 3)))
    for f in faults:
        if not 0 <= f.rank < world:
            raise ValueError(f"failure rank {f.rank} is not a worker (0..{world - 1}): set failure.rank in range")
        if f.phase not in PHASES:
            raise ValueError(f"failure.phase={f.phase!r}: use one of {', '.join(PHASES)}")
        if f.kind not in ("kill", "hang"):
            raise ValueError(f"failure fault kind {f.kind!r}: use kill or hang")
        if f.step is None and f.at_s is None:
            raise ValueError("a scheduled fault needs a step or at_s: set failure.faults[i].step")
    return faults


def worker_side(faults: list[FaultSpec], device: int) -> list[FaultSpec]:
    """The kills device ``device`` fires on itself (those pinned to a worker phase)."""
    return [f for f in faults if f.rank == device and f.kind == "kill" and f.phase in WORKER_PHASES and f.step is not None]


class SelfKill:
    """Fires this worker's own phase-pinned kills; each fires at most once (the process dies).

    ``announce(wall_time)`` is called just before, so the controller can time detection.
    """

    def __init__(self, faults: list[FaultSpec], *, announce: Callable[[float], None]):
        self._at = {(f.step, f.phase) for f in faults}
        self._announce = announce

    def __call__(self, step: int, phase: str) -> None:
        if (step, phase) in self._at:
            self._announce(time.time())
            os.kill(os.getpid(), signal.SIGKILL)
