"""What faults to inject (Hydra group ``failure``): real SIGKILLs, SIGSTOPs and errors, at any moment.

Kinds of fault, each on a device (``rank``) or a whole node (``node``):

- ``kill``: SIGKILL of the worker process, as abruptly as a lost device;
- ``hang``: SIGSTOP of the worker (caught by its missing heartbeat);
- ``stall``: the worker's main thread blocks for good while its heartbeat goes on
  (caught only by the progress watchdog);
- ``error`` / ``device_error``: an exception in the worker — an error of the run,
  which stops it, or a fault of the device itself, which loses that device;
- ``corrupt``: silent data corruption, once: ``value`` (``nan``, ``inf``, or ``flip``: its lowest bit
  flipped) in one element of the worker's gradients (``target=grad``, in the ``backward`` of ``step``) or
  of its parameters (``target=param``, at the ``optimizer`` phase of ``step``, after its commit);
  ``target=checkpoint`` (``value=flip``) rots every checkpoint shard file it writes from the checkpoint of
  ``step`` committed steps on, once written (a failing disk);
- ``slow``: from the start of ``step`` on, the device computes ``factor`` times slower (every forward and
  backward it runs, or the probe it runs while idle, is stretched), for ``duration_s`` seconds (null: for good) —
  a fail-slow device (thermal throttling, a degraded link, a noisy neighbour);
- ``stuck_abort``: from ``step`` on, the worker's next abort of a broken generation's
  communicators never returns (as ``ncclCommAbort`` can block when a peer cannot abort);
  it takes another fault to break a generation, so it comes in a ``schedule``;
- ``node_kill``: SIGKILL of the node agent and every process under it (its workers) at once;
- ``node_hang``: SIGSTOP of the node agent (a partition), resumed after ``resume_after_s``.

A fault pinned to a ``step`` and ``phase`` is fired by the victim worker itself at
that exact point; for node faults, the node's first device with a stage announces it
there and the node's agent fires it as soon as the controller has noted where it
struck (the agent dies with its node, so it could not report that afterwards). Phases of
a step: ``eval`` (the validation loss taken before it, where due; step ``train.steps``: after the
last), ``forward``, ``backward``, ``sync``, ``optimizer``, or ``any`` (a uniformly
random moment of the step's compute, at its end at the latest, before its commit). A device the
plan leaves idle fires its faults of a step as that step starts.
Phases of the recovery that resumes at ``step``: ``recovery`` (as the worker starts
on the new generation), ``rebuild`` (between connecting its first group and its
other groups), ``transfer`` (at round ``round`` of the state transfer, by default
the victim's first), ``redo`` (the forward of the redone step). ``decision`` fires
from the controller while it decides on an earlier fault at ``step``. A fault at
``at_s`` (seconds after training starts) is fired from outside by the controller,
wherever the victim is — inside a recovery too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from enum import StrEnum


class FaultKind(StrEnum):
    """A fault (see the module doc): of a device, or of a whole node (``node_*``)."""

    kill = "kill"
    hang = "hang"
    stall = "stall"
    error = "error"
    device_error = "device_error"
    corrupt = "corrupt"
    slow = "slow"
    stuck_abort = "stuck_abort"
    node_kill = "node_kill"
    node_hang = "node_hang"


FailureKind = StrEnum("FailureKind", ["none", *FaultKind, "schedule", "random"])
"""``failure.kind``: no fault, one fault of a :class:`FaultKind`, a ``schedule`` of them, or ``random`` ones."""


class FaultPhase(StrEnum):
    """Where a fault pinned to a step strikes: a phase of the step, of the recovery resuming at it, or the
    controller's decision (see the module doc)."""

    eval = "eval"
    forward = "forward"
    backward = "backward"
    sync = "sync"
    optimizer = "optimizer"
    any = "any"
    recovery = "recovery"
    rebuild = "rebuild"
    transfer = "transfer"
    redo = "redo"
    decision = "decision"


class CorruptTarget(StrEnum):
    """What a ``corrupt`` fault writes into: a gradient (in the backward), a parameter (after the commit), or the
    checkpoint shard files the worker writes (once written, from a step on: a failing disk)."""

    grad = "grad"
    param = "param"
    checkpoint = "checkpoint"


class CorruptValue(StrEnum):
    """What a ``corrupt`` fault writes: ``nan``, ``inf``, or the element with its lowest bit flipped."""

    nan = "nan"
    inf = "inf"
    flip = "flip"


P, K = FaultPhase, FaultKind
STEP_PHASES = (P.eval, P.forward, P.backward, P.sync, P.optimizer, P.any)
RECOVERY_PHASES = (P.recovery, P.rebuild, P.transfer, P.redo)
CONTROLLER_PHASES = (P.decision,)
NODE_KINDS = (K.node_kill, K.node_hang)
DEVICE_KINDS = tuple(k for k in K if k not in NODE_KINDS)
MAIN_THREAD_KINDS = (K.stall, K.error, K.device_error, K.corrupt)  # fired where the worker is, never from outside
STUCK_ABORT = K.stuck_abort  # not fired at a phase: it blocks the victim's next abort (WorkerFaults.abort_started)
PACED_KINDS = (K.slow,)  # not fired at a phase: they pace the victim's compute from a step on (WorkerFaults.pace)


@dataclass(frozen=True)
class FaultSpec:
    """One injected fault (see the module doc); pinned to ``step`` and ``phase``, or at ``at_s``."""

    kind: FaultKind = FaultKind.kill
    rank: int | None = 1
    node: int | None = None
    step: int | None = None
    phase: FaultPhase = FaultPhase.any
    at_s: float | None = None
    round: int | None = None
    resume_after_s: float | None = None
    target: CorruptTarget = CorruptTarget.grad  # kind=corrupt: what is corrupted
    value: str = CorruptValue.nan  # kind=corrupt: a CorruptValue (a str: Hydra reads nan and inf as floats)
    factor: float = 3.0  # kind=slow: how many times slower the device computes
    duration_s: float | None = None  # kind=slow: for how long (None: for good)

    def describe(self) -> str:
        who = f"node {self.node}" if self.kind in NODE_KINDS else f"device {self.rank}"
        when = f"at {self.at_s:g} s" if self.at_s is not None else f"in step {self.step}, phase {self.phase}"
        what = f" ({self.target} {self.value})" if self.kind == FaultKind.corrupt else ""
        if self.kind == FaultKind.slow:
            what = f" (×{self.factor:g}" + (f" for {self.duration_s:g} s)" if self.duration_s is not None else ")")
        return f"{self.kind}{what} of {who} {when}"


@dataclass
class FailureConfig:
    kind: FailureKind = FailureKind.none  # none | kill | hang | stall | error | device_error | corrupt | slow
    #                                        | stuck_abort | node_kill | node_hang | schedule | random
    rank: int = 1
    node: int = 1
    step: int = 5
    phase: FaultPhase = FaultPhase.any
    round: int | None = None  # phase=transfer: the round (default: the victim's first)
    resume_after_s: float = 3.0  # node_hang: the agent is resumed (SIGCONT) this long after it stopped
    target: CorruptTarget = CorruptTarget.grad  # corrupt: grad | param
    value: str = CorruptValue.nan  # corrupt: nan | inf | flip (str: Hydra reads nan and inf as floats)
    factor: float = 3.0  # slow: how many times slower the device computes (> 1)
    duration_s: float | None = None  # slow: for how long, in seconds (null: for good)
    faults: list[FaultSpec] = field(default_factory=list)  # kind=schedule
    mtbf_s: float = 6.0  # kind=random: mean time between faults over the whole job
    max_faults: int = 2  # kind=random
    kinds: list[FaultKind] = field(default_factory=lambda: [FaultKind.kill])  # kind=random: drawn uniformly
    rejoin_after_s: float | None = None  # restart a lost worker process after this long (it re-joins)
    seed: int = 0


def planned_faults(cfg: FailureConfig, *, world: int, nnodes: int = 1) -> list[FaultSpec]:
    """The faults a ``failure`` config asks for, validated (the typed config, or its composed node).

    Raises:
        ValueError: naming the ``failure.*`` key and the fix.
    """
    kind = cfg.kind
    if kind not in list(FailureKind):
        raise ValueError(f"failure.kind={kind!r}: use one of {', '.join(list(FailureKind))}")
    if kind == "none":
        faults = []
    elif kind in list(FaultKind):
        faults = [FaultSpec(kind=kind, rank=cfg.rank, node=cfg.node, step=cfg.step, phase=cfg.phase, round=cfg.round,
                            resume_after_s=cfg.resume_after_s, target=cfg.target, value=cfg.value, factor=cfg.factor,
                            duration_s=cfg.duration_s)]
    elif kind == "schedule":
        if not cfg.faults:
            raise ValueError("failure=schedule with an empty failure.faults: list faults, or use failure=none")
        faults = [f if isinstance(f, FaultSpec) else FaultSpec(**f) for f in cfg.faults]
    else:
        faults = _random_faults(cfg, world=world, nnodes=nnodes)
    for i, f in enumerate(faults):
        _check_fault(f, key="failure" if kind != "schedule" else f"failure.faults[{i}]", world=world, nnodes=nnodes)
    if faults and all(f.kind == STUCK_ABORT for f in faults):
        raise ValueError(f"failure: {STUCK_ABORT} only blocks an abort, and nothing breaks a generation: use "
                         "failure=schedule with a kill beside it")
    rejoin = cfg.rejoin_after_s
    if rejoin is not None and rejoin < 0:
        raise ValueError(f"failure.rejoin_after_s={rejoin}: use null (never) or a delay ≥ 0")
    return faults


def _random_faults(cfg: FailureConfig, *, world: int, nnodes: int) -> list[FaultSpec]:
    if cfg.mtbf_s <= 0 or cfg.max_faults < 0:
        raise ValueError(f"failure.mtbf_s={cfg.mtbf_s} / failure.max_faults={cfg.max_faults}: must be > 0 and ≥ 0")
    kinds = list(cfg.kinds)
    timed = [k for k in list(FaultKind) if k not in (*MAIN_THREAD_KINDS, STUCK_ABORT)]
    if not kinds or any(k not in timed for k in kinds):
        raise ValueError(f"failure.kinds={kinds}: random faults are fired from outside; pick from {', '.join(timed)}")
    rng = random.Random(cfg.seed)
    at, faults = 0.0, []
    for _ in range(cfg.max_faults):
        at += rng.expovariate(1.0 / cfg.mtbf_s)
        kind = rng.choice(kinds)
        if kind in NODE_KINDS:
            faults.append(FaultSpec(kind=kind, rank=None, node=rng.randrange(1, nnodes) if nnodes > 1 else 1,
                                    at_s=round(at, 3), resume_after_s=cfg.resume_after_s))
        elif kind in PACED_KINDS:
            faults.append(FaultSpec(kind=kind, rank=rng.randrange(world), at_s=round(at, 3), factor=cfg.factor,
                                    duration_s=cfg.duration_s))
        else:
            faults.append(FaultSpec(kind=kind, rank=rng.randrange(world), at_s=round(at, 3)))
    return faults


def _check_fault(f: FaultSpec, *, key: str, world: int, nnodes: int) -> None:
    if f.kind not in list(FaultKind):
        raise ValueError(f"{key}.kind={f.kind!r}: use one of {', '.join(list(FaultKind))}")
    if f.kind in NODE_KINDS:
        if nnodes < 2 or f.node is None or not 1 <= f.node < nnodes:
            raise ValueError(
                f"{key}.node={f.node}: a node fault needs a node other than node 0 (which hosts the controller) "
                f"of launcher.nnodes={nnodes}: use 1..{nnodes - 1}" if nnodes > 1 else
                f"{key}.kind={f.kind} needs several nodes (launcher.nnodes > 1); on one host use kill or hang"
            )
        if f.kind == "node_hang" and (f.resume_after_s is None or f.resume_after_s < 0):
            raise ValueError(f"{key}.resume_after_s={f.resume_after_s}: a node_hang needs a delay ≥ 0 before SIGCONT")
    elif f.rank is None or not 0 <= f.rank < world:
        raise ValueError(f"{key}.rank={f.rank} is not a worker (0..{world - 1}): set it in range")
    if f.phase not in list(FaultPhase):
        raise ValueError(f"{key}.phase={f.phase!r}: use one of {', '.join(FaultPhase)}")
    if f.step is None and f.at_s is None:
        raise ValueError(f"{key} needs a step (with a phase) or at_s: set {key}.step")
    if f.step is not None and f.step < 0 or f.at_s is not None and f.at_s < 0:
        raise ValueError(f"{key}: step and at_s must be ≥ 0")
    if f.phase in RECOVERY_PHASES + CONTROLLER_PHASES and f.step is None:
        raise ValueError(f"{key}.phase={f.phase} belongs to the recovery resuming at a step: set {key}.step")
    if f.kind == STUCK_ABORT and (f.phase != "any" or f.at_s is not None):
        raise ValueError(f"{key}: {STUCK_ABORT} blocks the device's next abort from its step on: set its rank and "
                         "step only (phase=any, no at_s)")
    if f.phase == "decision" and f.kind != "kill":
        raise ValueError(f"{key}: phase=decision fires from the controller and only kills: use kind=kill")
    if f.kind == K.corrupt:
        _check_corrupt(f, key)
    if f.kind in PACED_KINDS:
        _check_slow(f, key)
    if f.kind in MAIN_THREAD_KINDS and (f.phase == "any" or f.at_s is not None):
        raise ValueError(f"{key}.kind={f.kind} acts on the worker's own thread: pin it to a phase "
                         "(forward, backward, sync, optimizer or a recovery phase), not phase=any or at_s")


def _check_corrupt(f: FaultSpec, key: str) -> None:
    if f.target not in list(CorruptTarget):
        raise ValueError(f"{key}.target={f.target}: use one of {', '.join(CorruptTarget)}")
    if f.value not in list(CorruptValue):
        raise ValueError(f"{key}.value={f.value}: use one of {', '.join(CorruptValue)}")
    phase = {CorruptTarget.grad: P.backward, CorruptTarget.param: P.optimizer, CorruptTarget.checkpoint: P.optimizer}[
        f.target]
    if f.phase != phase:
        raise ValueError(f"{key}.phase={f.phase}: a {K.corrupt} of a {f.target} strikes in the {phase} phase: set "
                         f"{key}.phase={phase}")
    if f.target == CorruptTarget.checkpoint and f.value != CorruptValue.flip:
        raise ValueError(f"{key}.value={f.value}: a {K.corrupt} of a checkpoint flips bytes of its files: use value=flip")
    if f.target == CorruptTarget.grad and f.value == CorruptValue.flip:
        raise ValueError(f"{key}: a flipped bit of a gradient is finite and reaches every replica through the sync, "
                         "where nothing can tell it: use value=nan or inf, or target=param")


def _check_slow(f: FaultSpec, key: str) -> None:
    if not f.factor > 1:
        raise ValueError(f"{key}.factor={f.factor}: a slow device computes factor times slower: use a factor > 1")
    if f.duration_s is not None and not f.duration_s > 0:
        raise ValueError(f"{key}.duration_s={f.duration_s}: use null (for good) or a duration > 0 seconds")
    if f.phase != "any" or (f.at_s is None) == (f.step is None):
        raise ValueError(f"{key}: a {K.slow} device is slow from the start of its step (or from at_s) on: set its "
                         "rank and a step or at_s, no phase")


def worker_faults(faults: list[FaultSpec]) -> list[FaultSpec]:
    """The faults fired by workers themselves (pinned to a step and a worker's phase)."""
    return [f for f in faults if f.step is not None and f.at_s is None and f.phase not in CONTROLLER_PHASES]


def controller_faults(faults: list[FaultSpec]) -> list[FaultSpec]:
    """The faults fired by the controller (at a wall-clock time, or during its decision)."""
    return [f for f in faults if f not in worker_faults(faults)]


def node_firer(devices_with_stage: set[int], node_devices: list[int]) -> int:
    """The device of a node that fires the node's pinned faults: its first with a stage, else its first."""
    staged = [d for d in node_devices if d in devices_with_stage]
    return (staged or node_devices)[0]


def without(faults: list[FaultSpec], fired: list[FaultSpec]) -> list[FaultSpec]:
    """``faults`` less those already fired (in an earlier launch of the same job)."""
    return [f for f in faults if f not in fired]


def as_record(f: FaultSpec) -> dict:
    return {k: v for k, v in f.__dict__.items()}


def from_record(d: dict) -> FaultSpec:
    return replace(FaultSpec(), **d)


class Injector:
    """The faults the controller fires from outside: at a wall-clock time, or while it decides."""

    def __init__(self, faults: list[FaultSpec]):
        self.timed = sorted((f for f in faults if f.at_s is not None), key=lambda f: f.at_s)
        self.in_decision = [f for f in faults if f.at_s is None and f.phase in CONTROLLER_PHASES]

    def due(self, elapsed_s: float) -> list[FaultSpec]:
        """Timed faults whose time came (each once)."""
        due = [f for f in self.timed if f.at_s <= elapsed_s]
        self.timed = self.timed[len(due):]
        return due

    def during_decision(self, step: int) -> list[FaultSpec]:
        """Kills to fire while deciding on a fault at ``step`` (each once)."""
        due = [f for f in self.in_decision if f.step == step]
        self.in_decision = [f for f in self.in_decision if f not in due]
        return due
