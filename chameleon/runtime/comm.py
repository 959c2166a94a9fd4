"""One generation of process groups, and waits that never block past a fault.

Gloo cannot interrupt a blocked collective (``../shared/mission/probe.md`` §4), so
every collective and point-to-point op is issued asynchronously and the main thread
never blocks in C++: a per-generation waiter thread calls ``Work.wait()`` (gloo's
point-to-point ``Work.is_completed()`` only turns true inside ``wait()``), while the
main thread polls the waiter's result and the fault flag the controller sets in the
store. On a fault the waiter may stay blocked until the group timeout; it is a
daemon thread of an abandoned generation and is never reused. Groups of a
generation that saw a fault are never reused either: the next generation builds
new ones on a fresh store prefix.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
POLL_INTERVAL_S = 0.001


class PeerFailure(RuntimeError):
    """A peer of this generation failed; the in-flight step must be abandoned."""


def fault_key(generation: int) -> str:
    """The store key the controller sets when a worker of ``generation`` fails."""
    return f"fault/gen{generation}"


def connect_store(host: str, port: int, *, timeout_s: float) -> dist.TCPStore:
    """A client of the controller's TCPStore."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Generation:
    """The world process group of one generation, with fault-aware waits.

    Args:
        store: the controller's store (unprefixed).
        generation: generation number; names the store prefix of its groups.
        rank: this worker's rank in the generation.
        world: number of workers in the generation.
        device: ``cpu``, ``cuda`` or ``npu``.
        timeout_s: collective timeout; never reached on a fault, which is polled instead.
    """

    def __init__(self, store: dist.Store, *, generation: int, rank: int, world: int, device: str, timeout_s: float):
        self.store = store
        self.generation = generation
        self.rank = rank
        self.world = world
        self.timeout = timedelta(seconds=timeout_s)
        self._fault = fault_key(generation)
        dist.init_process_group(
            BACKENDS[device],
            store=dist.PrefixStore(f"gen{generation}", store),
            rank=rank,
            world_size=world,
            timeout=self.timeout,
        )
        self._subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._waiter = _Waiter(name=f"chameleon-waiter-gen{generation}")

    def group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The group over ``ranks`` (the world group when it covers everyone).

        Every rank must ask for the same groups in the same order; ranks outside
        ``ranks`` get ``None``.
        """
        if len(ranks) == self.world:
            return dist.group.WORLD
        if ranks not in self._subgroups:
            self._subgroups[ranks] = dist.new_group(list(ranks), timeout=self.timeout)
        return self._subgroups[ranks] if self.rank in ranks else None

    def check(self) -> None:
        """Raise :class:`PeerFailure` if the controller flagged a fault in this generation."""
        if self.store.check([self._fault]):
            raise PeerFailure(f"a peer of generation {self.generation} failed")

    def wait(self, *works: dist.Work) -> None:
        """Wait for ``works`` by polling, raising :class:`PeerFailure` as soon as a fault is flagged."""
        for work in works:
            pending = self._waiter.submit(work)
            while not pending.done.wait(POLL_INTERVAL_S):
                self.check()
            if pending.error is not None:
                raise PeerFailure(str(pending.error)) from pending.error

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        """In-place sum over ``group`` (default: the world)."""
        self.wait(dist.all_reduce(tensor, group=group or dist.group.WORLD, async_op=True))

    def close(self) -> None:
        """Tear down after a clean run (never after a fault: broken groups are left referenced)."""
        dist.destroy_process_group()


class _Pending:
    __slots__ = ("work", "done", "error")

    def __init__(self, work: dist.Work):
        self.work = work
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Waiter:
    """A daemon thread that blocks in ``Work.wait()`` so the main thread never does."""

    def __init__(self, *, name: str):
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, work: dist.Work) -> _Pending:
        pending = _Pending(work)
        self._queue.put(pending)
        return pending

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                pending.work.wait()
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                pending.error = err
            pending.done.set()
