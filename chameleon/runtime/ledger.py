"""The commit ledger: a pure state machine of generations, steps and samples.

It knows which generation is current and who belongs to it, who is ready, which
step is committed and which samples each step trained, and which checkpoint parts
are on disk. It does no I/O: the controller feeds it messages and carries out what
it returns. ``docs/protocol.md`` gives the state table it implements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chameleon.runtime.errors import TrainingError
from chameleon.runtime.messages import CheckpointSaved, Ready, Synced


@dataclass(frozen=True)
class StartGeneration:
    """Every member of ``generation`` is ready: it may start training at ``resume_step``."""

    generation: int
    resume_step: int


@dataclass(frozen=True)
class CommitStep:
    """``step`` trained exactly its samples: commit it."""

    step: int
    loss: float
    sample_ids: tuple[int, ...]
    compute_s: float
    grad_norm: float | None = None


@dataclass(frozen=True)
class CheckpointComplete:
    """Every writer of ``generation`` saved its part of the checkpoint at ``step`` committed steps."""

    step: int
    generation: int
    writers: tuple[int, ...]


@dataclass
class _Book:
    loss: float = 0.0
    sample_ids: list[int] = field(default_factory=list)
    compute_s: float = 0.0
    grad_norm: float | None = None
    reported: set[int] = field(default_factory=set)


class Ledger:
    """Generations, readiness, commits and checkpoint parts of one job (see the module doc).

    Args:
        global_batch: samples per step; step ``k`` trains ``[k·B, (k+1)·B)``.
        steps: the last step is ``steps − 1``.
        first_step: the first step to train (after a resume, the checkpoint's committed steps).
    """

    def __init__(self, *, global_batch: int, steps: int, first_step: int = 0):
        self.global_batch, self.steps = global_batch, steps
        self.generation = -1
        self.members: frozenset[int] = frozenset()
        self.trainers: frozenset[int] = frozenset()
        self.writers: frozenset[int] = frozenset()
        self.resume_step = first_step
        self.committed = first_step - 1
        self.ready: set[int] = set()
        self.started = False
        self.broken = False
        self._books: dict[int, _Book] = {}
        self._writers_of: dict[int, frozenset[int]] = {}
        self._saved: dict[tuple[int, int], set[int]] = {}

    @property
    def finished(self) -> bool:
        return self.committed >= self.steps - 1

    @property
    def next_step(self) -> int:
        return self.committed + 1

    def publish(self, generation: int, *, members, trainers, writers, resume_step: int) -> None:
        """A new generation: ``members`` establish it, ``trainers`` report steps, ``writers`` save checkpoints.

        ``resume_step`` is the first step it trains (a checkpoint reload may go back).
        """
        if generation <= self.generation:
            raise ValueError(f"generation {generation} is not newer than {self.generation}")
        if not set(trainers) <= set(members) or not set(writers) <= set(trainers):
            raise ValueError("trainers must be members and writers trainers")
        self.generation = generation
        self.members, self.trainers, self.writers = frozenset(members), frozenset(trainers), frozenset(writers)
        self.resume_step, self.committed = resume_step, resume_step - 1
        self.ready, self.started, self.broken = set(), False, False
        self._books.clear()
        self._writers_of[generation] = self.writers  # an intact earlier generation may still finish a checkpoint

    def break_generation(self) -> None:
        """A member was lost: nothing of this generation commits any more, not even its checkpoints."""
        self.broken = True
        self._books.clear()
        self._writers_of.pop(self.generation, None)
        self._saved = {k: v for k, v in self._saved.items() if k[0] != self.generation}

    def on_ready(self, msg: Ready) -> StartGeneration | None:
        if self._stale(msg.generation) or self.started or msg.device not in self.members:
            return None
        self.ready.add(msg.device)
        if self.ready >= self.members:
            self.started = True
            return StartGeneration(self.generation, self.resume_step)
        return None

    def on_synced(self, msg: Synced) -> CommitStep | None:
        """Book a device's report of a step; the step commits once every trainer reported it.

        Raises:
            TrainingError: the step's samples are not exactly its global samples, each once.
        """
        if self._stale(msg.generation) or not self.started or msg.device not in self.trainers:
            return None
        if msg.step != self.next_step:
            raise TrainingError(f"device {msg.device} synced step {msg.step} while step {self.next_step} is open")
        book = self._books.setdefault(msg.step, _Book())
        if msg.device in book.reported:
            raise TrainingError(f"device {msg.device} reported step {msg.step} twice")
        book.loss += msg.loss_sum
        book.sample_ids.extend(msg.sample_ids)
        book.compute_s = max(book.compute_s, msg.compute_s)
        book.grad_norm = msg.grad_norm if msg.grad_norm is not None else book.grad_norm
        book.reported.add(msg.device)
        if book.reported < self.trainers:
            return None
        del self._books[msg.step]
        start = msg.step * self.global_batch
        ids = sorted(book.sample_ids)
        if ids != list(range(start, start + self.global_batch)):
            raise TrainingError(
                f"step {msg.step} trained samples {ids} instead of [{start}, {start + self.global_batch}): "
                "samples were lost or duplicated"
            )
        self.committed = msg.step
        return CommitStep(msg.step, book.loss, tuple(ids), book.compute_s, book.grad_norm)

    def on_checkpoint_saved(self, msg: CheckpointSaved) -> CheckpointComplete | None:
        """Book a writer's part; complete once every writer of its generation saved (an intact earlier one too)."""
        writers = self._writers_of.get(msg.generation)
        if writers is None or msg.device not in writers:
            return None
        saved = self._saved.setdefault((msg.generation, msg.step), set())
        saved.add(msg.device)
        if saved >= writers:
            del self._saved[(msg.generation, msg.step)]
            return CheckpointComplete(msg.step, msg.generation, tuple(sorted(writers)))
        return None

    def unreported(self) -> frozenset[int]:
        """Trainers that have not reported the open step (members not ready, before the start)."""
        if not self.started:
            return self.members - self.ready
        book = self._books.get(self.next_step)
        return self.trainers - (book.reported if book else set())

    def _stale(self, generation: int) -> bool:
        return generation != self.generation or self.broken
