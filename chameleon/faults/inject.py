"""Fault injection: fires a worker's pinned faults where it is, and a node's with real signals."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from chameleon.faults.spec import (
    DEVICE_KINDS, NODE_KINDS, PACED_KINDS, STEP_PHASES, STUCK_ABORT, CorruptTarget, FaultSpec,
)
from chameleon.runtime.node.beacon import Beacon
from chameleon.runtime.protocol.errors import DeviceFault
from chameleon.runtime.protocol.position import Position


class WorkerFaults:
    """Fires one worker's pinned faults; shows every phase change on its beacon.

    Args:
        faults: every worker-fired fault of the job (node faults are fired by the
            node's first device with a stage, see :meth:`node_firer`).
        device: this worker's device.
        beacon: this worker's beacon.
        announce: ``announce(fault, position)`` is called just before a fault fires; a node fault is
            then fired by the node's agent, once the controller noted where it struck.
        node_of: the node of a device.
    """

    def __init__(self, faults: list[FaultSpec], *, device: int, beacon: Beacon,
                 announce: Callable[[FaultSpec, Position], None], node_of: Callable[[int], int]):
        self.device, self.beacon = device, beacon
        self._announce, self._node_of = announce, node_of
        self._mine = [f for f in faults if f.rank == device and f.kind in DEVICE_KINDS]
        self._node = [f for f in faults if f.kind in NODE_KINDS and f.node == node_of(device)]
        self._firer = True
        self._generation = 0
        self._resume = 0
        self._timer: threading.Timer | None = None
        self._fired: set[FaultSpec] = set()
        self._rng = random.Random(device)
        self.stage = None  # where a corrupt fault writes: the worker's StageState while it trains, else None
        self._slow: tuple[float, float] | None = None  # a slow fault's factor and when it ends (monotonic)

    def enter(self, generation: int, *, resume_step: int, firer: bool) -> None:
        """Start on a generation; ``firer``: this device fires its node's faults in it."""
        self._generation, self._resume, self._firer = generation, resume_step, firer

    def phase(self, phase: str, *, step: int, detail: int = -1) -> None:
        """Enter beacon phase ``phase`` of ``step`` (a recovery phase: of the recovery resuming at ``step``).

        ``rebuild`` with ``detail < 0`` starts a generation (fires ``recovery`` faults);
        with ``detail ≥ 0`` its first group is connected (fires ``rebuild`` faults).
        """
        self.beacon.at(phase, step=step, generation=self._generation, detail=detail)
        recovering = self._generation > 0 and step == self._resume
        for f in self._armed():
            if f.step != step:
                continue
            hit = f.phase == phase and phase in STEP_PHASES
            hit |= recovering and phase == "rebuild" and f.phase == ("recovery" if detail < 0 else "rebuild")
            hit |= recovering and f.phase == "transfer" and phase == "transfer" and f.round in (None, detail)
            hit |= recovering and f.phase == "redo" and phase == "forward"
            if hit:
                self._fire(f)

    def transfer_done(self, step: int) -> None:
        """A transfer this device took no (or not that) round in still fires its pinned transfer fault."""
        if self._generation > 0 and step == self._resume:
            for f in self._armed():
                if f.step == step and f.phase == "transfer":
                    self._fire(f)

    def step_started(self, step: int, typical_s: float) -> None:
        """Arm ``phase=any`` faults of ``step``: a timer over the step's typical compute time; a ``slow`` fault
        of ``step`` (or before) starts pacing."""
        self._start_slow(step)
        due = [f for f in self._armed() if f.step == step and f.phase == "any"]
        if due:
            delay = self._rng.uniform(0.0, typical_s)
            self._timer = threading.Timer(delay, self._fire, args=(due[0],))
            self._timer.daemon = True
            self._timer.start()

    def idle_step(self, step: int) -> None:
        """A device the plan leaves idle takes part in no phase of ``step``: its faults of that step (and of the
        redo, when a recovery resumes at it) fire as it starts."""
        redo = self._generation > 0 and step == self._resume
        self.beacon.at("idle", step=step, generation=self._generation)
        self._start_slow(step)
        for f in self._armed():
            if f.step == step and (f.phase in STEP_PHASES or redo and f.phase == "redo"):
                self._fire(f)

    def pace(self, seconds: float) -> float:
        """A forward, backward or probe computed ``seconds``: while a ``slow`` fault lasts, it takes ``factor``
        times as long (the device sleeps the difference, leaving the host's cores to the others, as a throttled
        GPU would). Returns the seconds it took in all."""
        if self._slow is not None:
            factor, until = self._slow
            if time.monotonic() < until:
                time.sleep((factor - 1.0) * seconds)
                return factor * seconds
        return seconds

    def injected(self, fault: FaultSpec) -> None:
        """A ``slow`` fault the controller fired at its time: this device is slow from the step it starts next."""
        if fault.rank == self.device:
            self._mine.append(replace(fault, step=0))

    def _start_slow(self, step: int) -> None:
        for f in self._mine:
            if f.kind in PACED_KINDS and f not in self._fired and f.step is not None and f.step <= step:
                self._fired.add(f)
                self._announce(f, self.beacon.position())
                lasts = f.duration_s if f.duration_s is not None else float("inf")
                self._slow = f.factor, time.monotonic() + lasts

    def step_synced(self) -> None:
        """The step's compute is over: a pending ``any`` fault fires now, before the commit."""
        timer, self._timer = self._timer, None
        if timer is not None and timer.is_alive():
            timer.cancel()
            self._fire(timer.args[0])

    def abort_started(self) -> None:
        """This device starts aborting a broken generation: an armed ``stuck_abort`` whose step was reached
        blocks the abort for good (called on the aborting thread)."""
        step = self.beacon.position().step
        for f in self._mine:
            if f.kind == STUCK_ABORT and f not in self._fired and f.step <= step:
                self._fired.add(f)
                self._announce(f, self.beacon.position())
                threading.Event().wait()

    def checkpoint_written(self, step: int, path: Path) -> None:
        """This device wrote its shard file of the checkpoint of ``step`` committed steps: a ``corrupt`` of its
        checkpoints from a step on rots it (a failing disk), before the checkpoint is committed."""
        for f in self._mine:
            if f.kind == "corrupt" and f.target == CorruptTarget.checkpoint and f.step <= step:
                if f not in self._fired:
                    self._fired.add(f)
                    self._announce(f, self.beacon.position())
                rot(path)

    def _armed(self) -> list[FaultSpec]:
        node = self._node if self._firer else []
        return [f for f in self._mine + node
                if f not in self._fired and f.kind not in (STUCK_ABORT, *PACED_KINDS)
                and f.target != CorruptTarget.checkpoint]

    def _fire(self, f: FaultSpec) -> None:
        self._fired.add(f)
        self._announce(f, self.beacon.position())
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "stall":
            threading.Event().wait()  # alive and heartbeating, never progressing
        elif f.kind == "error":
            raise RuntimeError(f"injected error ({f.describe()})")
        elif f.kind == "device_error":
            raise DeviceFault(f"injected device fault ({f.describe()})")
        elif f.kind == "corrupt" and self.stage is not None:  # a device without a stage holds nothing to corrupt
            self.stage.corrupt(f.target, f.value)
        elif f.kind == "node_kill":
            threading.Event().wait()  # the agent takes the whole node down, this process with it


def rot(path: Path, *, at: float = 0.5, n: int = 64) -> None:
    """Bit rot: ``n`` bytes of a file inverted in place at fraction ``at`` of it, its size kept."""
    with open(path, "r+b") as f:
        f.seek(int(f.seek(0, os.SEEK_END) * at))
        start = f.tell()
        data = f.read(n)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))


def kill_node(agent_pid: int) -> None:
    """SIGKILL a node's agent and every process under it (forkserver, workers) at once, the caller last.

    The agent's own process tree, not its process group: an agent started from a script shares the
    script's group, which a node's loss must leave alone.
    """
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_bytes().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [agent_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    me = os.getpid()
    for pid in [p for p in tree if p != me] + ([me] if me in tree else []):
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, signal.SIGKILL)


def stop_and_resume(pid: int, after_s: float) -> None:
    """SIGSTOP ``pid`` now and SIGCONT it ``after_s`` seconds later, from a detached helper process."""
    subprocess.Popen(["sh", "-c", f"sleep {after_s}; kill -CONT {pid}"], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.kill(pid, signal.SIGSTOP)


def typical(durations: list[float], default: float) -> float:
    """The median of recent durations (the last 20), or ``default`` before any."""
    recent = sorted(durations[-20:])
    return recent[len(recent) // 2] if recent else default
