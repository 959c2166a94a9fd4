"""The commit ledger: a pure state machine of generations, steps and samples.

It knows which generation is current and who belongs to it, who is ready, which
step is committed and which samples each step trained, and which checkpoint parts
are on disk. Node agents report their nodes whole (every member ready, every
trainer synced, every writer saved), so the ledger books one report per node and
step: its work per step grows with nodes, not devices. It does no I/O: the
controller's protocol core feeds it and carries out what it returns.
``docs/protocol.md`` gives the state table it implements.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from chameleon.runtime.protocol.errors import TrainingError
from chameleon.runtime.protocol.messages import NodeEvaluated, NodeReady, NodeSaved, NodeSynced
from chameleon.runtime.protocol.topology import Topology


@dataclass(frozen=True)
class StartGeneration:
    """Every member of ``generation`` is ready: it may start training at ``resume_step``."""

    generation: int
    resume_step: int


@dataclass(frozen=True)
class CommitStep:
    """``step`` trained exactly its samples ``[start, stop)``: commit it, if :attr:`finite`.

    ``grad_norm`` is the whole plan's gradient norm (the trainers' squared parts summed
    in node order), ``t_synced`` when the slowest node's last trainer synced, ``corrupt``
    the trainers whose own gradients or loss were not finite before the sync, ``outvoted``
    the replicas whose state disagreed with the rest of their group (every one of a group
    with no majority), ``busy`` each trainer's own compute (seconds).
    """

    step: int
    loss: float
    samples: tuple[int, int]
    compute_s: float
    grad_norm: float | None
    t_synced: float
    corrupt: tuple[int, ...] = ()
    outvoted: tuple[int, ...] = ()
    busy: tuple[tuple[int, float], ...] = ()

    @property
    def finite(self) -> bool:
        """Whether the step may commit: its loss and gradient norm are finite, and so was every trainer's part."""
        return not self.corrupt and math.isfinite(self.loss) and (self.grad_norm is None or math.isfinite(self.grad_norm))

    @property
    def commits(self) -> bool:
        """Whether the step commits: finite, and every group of replicas agreed."""
        return self.finite and not self.outvoted


@dataclass(frozen=True)
class Evaluation:
    """Every node with trainers took its part of the validation loss before ``step``: the whole loss."""

    step: int
    loss: float


@dataclass(frozen=True)
class CheckpointComplete:
    """Every writer of ``generation`` saved its part of the checkpoint at ``step`` committed steps."""

    step: int
    generation: int
    writers: tuple[int, ...]


@dataclass
class _Book:
    reports: dict[int, NodeSynced] = field(default_factory=dict)
    evaluated: dict[int, dict[int, float]] = field(default_factory=dict)  # by step, each node's part


class Ledger:
    """Generations, readiness, commits and checkpoint parts of one job (see the module doc).

    Args:
        global_batch: samples per step; step ``k`` trains ``[k·B, (k+1)·B)``.
        steps: the last step is ``steps − 1``.
        topology: which node holds which device.
        first_step: the first step to train (after a resume, the checkpoint's committed steps).
    """

    def __init__(self, *, global_batch: int, steps: int, topology: Topology, first_step: int = 0):
        self.global_batch, self.steps, self.topology = global_batch, steps, topology
        self.generation = -1
        self.members: frozenset[int] = frozenset()
        self.trainers: frozenset[int] = frozenset()
        self.writers: frozenset[int] = frozenset()
        self.replica_groups: tuple[tuple[int, ...], ...] = ()
        self.resume_step = first_step
        self.committed = first_step - 1
        self.ready: set[int] = set()
        self.started = False
        self.broken = False
        self._trainers_on: dict[int, tuple[int, ...]] = {}
        self._book = _Book()
        self._writers_of: dict[int, frozenset[int]] = {}
        self._saved: dict[tuple[int, int], set[int]] = {}

    @property
    def finished(self) -> bool:
        return self.committed >= self.steps - 1

    @property
    def next_step(self) -> int:
        return self.committed + 1

    def publish(self, generation: int, *, members, trainers, writers, resume_step: int,
                replica_groups: tuple[tuple[int, ...], ...] = ()) -> None:
        """A new generation: ``members`` establish it, ``trainers`` report steps, ``writers`` save checkpoints.

        ``resume_step`` is the first step it trains (a checkpoint reload may go back); the devices of each of
        ``replica_groups`` hold the same regions, and their digests of a step must agree for it to commit.
        """
        if generation <= self.generation:
            raise ValueError(f"generation {generation} is not newer than {self.generation}")
        if not set(trainers) <= set(members) or not set(writers) <= set(trainers):
            raise ValueError("trainers must be members and writers trainers")
        self.generation = generation
        self.members, self.trainers, self.writers = frozenset(members), frozenset(trainers), frozenset(writers)
        self.replica_groups = replica_groups
        self._trainers_on = {}
        for d in sorted(self.trainers):
            node = self.topology.node_of(d)
            self._trainers_on[node] = self._trainers_on.get(node, ()) + (d,)
        self.resume_step, self.committed = resume_step, resume_step - 1
        self.ready, self.started, self.broken = set(), False, False
        self._book = _Book()
        self._writers_of[generation] = self.writers  # an intact earlier generation may still finish a checkpoint

    def break_generation(self) -> None:
        """A member was lost: nothing of this generation commits any more, not even its checkpoints."""
        self.broken = True
        self._book = _Book()
        self._writers_of.pop(self.generation, None)
        self._saved = {k: v for k, v in self._saved.items() if k[0] != self.generation}

    def on_ready(self, msg: NodeReady) -> StartGeneration | None:
        if self._stale(msg.generation) or self.started:
            return None
        self.ready.update(d for d in msg.devices if d in self.members)
        if self.ready >= self.members:
            self.started = True
            return StartGeneration(self.generation, self.resume_step)
        return None

    def on_synced(self, msg: NodeSynced) -> CommitStep | None:
        """Book a node's report of a step; the step commits once every node with trainers reported it, if it is
        finite (a step that is not stays open for its replay).

        Raises:
            TrainingError: the report is out of order or names other trainers than the node's, or the
                step's samples are not exactly its global samples, each once.
        """
        if self._stale(msg.generation) or not self.started:
            return None
        if msg.step != self.next_step:
            raise TrainingError(f"node {msg.node} synced step {msg.step} while step {self.next_step} is open")
        expected = self._trainers_on.get(msg.node, ())
        if tuple(msg.devices) != expected:
            raise TrainingError(f"node {msg.node} reported step {msg.step} for devices {list(msg.devices)}, "
                                f"but its trainers are {list(expected)}")
        reports = self._book.reports
        if msg.node in reports:
            raise TrainingError(f"node {msg.node} reported step {msg.step} twice")
        reports[msg.node] = msg
        if len(reports) < len(self._trainers_on):
            return None
        self._book.reports = {}
        start = msg.step * self.global_batch
        stop = start + self.global_batch
        ranges = sorted(r for n in reports.values() for r in n.samples)
        bounds = [start] + [x for r in ranges for x in r] + [stop]
        if not ranges or any(a != b for a, b in zip(bounds[::2], bounds[1::2])) or any(lo >= hi for lo, hi in ranges):
            raise TrainingError(
                f"step {msg.step} trained samples {_describe(ranges)} instead of [{start}, {stop}): "
                "samples were lost or duplicated"
            )
        nodes = [reports[n] for n in sorted(reports)]
        norms = [n.norm_sq for n in nodes if n.norm_sq is not None]
        step = CommitStep(
            msg.step, sum(n.loss_sum for n in nodes), (start, stop), max(n.compute_s for n in nodes),
            math.sqrt(sum(norms)) if norms else None, max(n.t_synced for n in nodes),
            tuple(sorted(d for n in nodes for d in n.corrupt)),
            _outvoted(self.replica_groups, dict(d for n in nodes for d in n.digests)),
            tuple(b for n in nodes for b in n.busy),
        )
        if step.commits:  # a step that is not finite stays open for its replay; one whose replicas disagree, for
            self.committed = msg.step  # the recovery from the loss of the outvoted
        return step

    def on_evaluated(self, msg: NodeEvaluated) -> Evaluation | None:
        """Book a node's part of a validation loss; whole once every node with trainers reported it."""
        if self._stale(msg.generation) or not self.started:
            return None
        if tuple(msg.devices) != self._trainers_on.get(msg.node, ()):
            raise TrainingError(f"node {msg.node} evaluated step {msg.step} for devices {list(msg.devices)}, "
                                f"but its trainers are {list(self._trainers_on.get(msg.node, ()))}")
        parts = self._book.evaluated.setdefault(msg.step, {})
        parts[msg.node] = msg.loss_sum
        if len(parts) < len(self._trainers_on):
            return None
        del self._book.evaluated[msg.step]
        return Evaluation(msg.step, sum(parts[n] for n in sorted(parts)))

    def on_saved(self, msg: NodeSaved) -> CheckpointComplete | None:
        """Book a node's writers' parts; complete once every writer of its generation saved (an intact earlier one too)."""
        writers = self._writers_of.get(msg.generation)
        if writers is None:
            return None
        saved = self._saved.setdefault((msg.generation, msg.step), set())
        saved.update(d for d in msg.devices if d in writers)
        if saved >= writers:
            del self._saved[(msg.generation, msg.step)]
            return CheckpointComplete(msg.step, msg.generation, tuple(sorted(writers)))
        return None

    def unreported(self) -> frozenset[int]:
        """Trainers whose node has not reported the open step (members not ready, before the start)."""
        if not self.started:
            return self.members - self.ready
        reported = self._book.reports
        return frozenset(d for n, ds in self._trainers_on.items() if n not in reported for d in ds)

    def _stale(self, generation: int) -> bool:
        return generation != self.generation or self.broken


def _outvoted(groups: tuple[tuple[int, ...], ...], digests: dict[int, int]) -> tuple[int, ...]:
    """The replicas whose digest differs from their group's majority; every one of a group with no majority."""
    if not digests:  # a step no trainer digested: nothing to compare
        return ()
    out = []
    for group in groups:
        held = {d: digests[d] for d in group if d in digests}
        if len(set(held.values())) > 1:
            value, count = Counter(held.values()).most_common(1)[0]
            out += [d for d in held if 2 * count <= len(held) or held[d] != value]
    return tuple(sorted(out))


def _describe(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"[{lo}, {hi})" for lo, hi in ranges[:8]) + (" …" if len(ranges) > 8 else "")
