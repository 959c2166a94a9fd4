"""One generation of process groups, built and used so that no fault can wedge a survivor.

Gloo cannot interrupt a blocked collective or connect (``../shared/mission/probe.md``
§4). So:

- A generation's groups are raw backend objects (``ProcessGroupGloo`` …) on a
  fresh store prefix, outside c10d's global default group: a generation that saw a
  fault is simply abandoned (kept referenced, never destroyed, never reused) and
  the next one is built beside it.
- Every blocking call — connecting the groups, ``Work.wait()`` of a collective or
  point-to-point op — runs in a daemon thread while the main thread polls its
  completion and the fault flag the controller sets in the store. Gloo's
  point-to-point ``Work.is_completed()`` only turns true inside ``wait()``, hence
  the thread rather than polling ``is_completed``. NCCL and HCCL mean something
  else by ``wait()``; their completion is polled as they define it
  (:mod:`chameleon.runtime.completion`).

Devices keep their ids across generations; each generation maps them to ranks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from chameleon.runtime.completion import abort, polls_completion, post_p2p, wait_polled

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
POLL_INTERVAL_S = 0.005  # fault-flag checks while waiting; completion itself wakes the wait at once
ABANDONED: list[Generation] = []  # broken generations stay referenced: their destructors would block


class PeerFailure(RuntimeError):
    """A peer of this generation failed; the in-flight work must be abandoned."""


def fault_key(generation: int) -> str:
    """The store key the controller sets when a worker of ``generation`` fails."""
    return f"fault/gen{generation}"


def connect_store(host: str, port: int, *, timeout_s: float) -> dist.TCPStore:
    """A client of the controller's TCPStore."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _new_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A raw process group of ``backend`` (gloo, nccl, or a registered plugin such as hccl)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    creator = dist.Backend._plugins[backend.upper()].creator_fn
    return creator(store, rank, size, timeout)


class Generation:
    """The process groups of one generation and fault-aware waits on them.

    Args:
        store: the controller's store (unprefixed), polled for the fault flag.
        connect_store: opens a fresh client of that store for this generation's
            rendezvous: a rendezvous blocked on a dead peer then holds only its own
            connection, never the one the fault flag is polled through.
        generation: generation number; names the store prefix of its groups.
        devices: every device of the generation; its rank is its index here.
        me: this worker's device id.
        backend: ``gloo``, ``nccl`` or ``hccl``.
        timeout_s: backend timeout; never reached on a fault, which is polled instead.
        groups: device sets that need their own group (sync and TP groups), in one
            order shared by every device; only members connect to a group.

    Raises:
        PeerFailure: when the controller flags a fault before the groups connect.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        connect_store: Callable[[], dist.Store],
        generation: int,
        devices: Sequence[int],
        me: int,
        backend: str,
        timeout_s: float,
        groups: Sequence[tuple[int, ...]] = (),
    ):
        self.store = store
        self.generation = generation
        self.devices = tuple(devices)
        self.me = me
        self.backend = backend
        self._rank = {d: r for r, d in enumerate(self.devices)}
        self._fault = fault_key(generation)
        self._waiter = _Waiter(name=f"chameleon-wait-gen{generation}")
        timeout = timedelta(seconds=timeout_s)
        prefix = f"gen{generation}"

        def connect() -> tuple[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]]:
            store = connect_store()
            world = _new_group(backend, dist.PrefixStore(f"{prefix}/world", store), self.rank, len(self.devices), timeout)
            subgroups = {}
            for members in dict.fromkeys(groups):
                if me in members and 1 < len(members) < len(self.devices):  # the world's own set uses the world
                    key = "-".join(map(str, members))
                    sub_store = dist.PrefixStore(f"{prefix}/group/{key}", store)
                    subgroups[members] = _new_group(backend, sub_store, members.index(me), len(members), timeout)
            return world, subgroups

        self.world, self._groups = self.call(connect)

    @property
    def rank(self) -> int:
        return self._rank[self.me]

    def rank_of(self, device: int) -> int:
        return self._rank[device]

    def group(self, members: tuple[int, ...]) -> dist.ProcessGroup:
        """The group over ``members`` (which must include this device and have been declared)."""
        return self.world if len(members) == len(self.devices) else self._groups[members]

    def check(self) -> None:
        """Raise :class:`PeerFailure` if the controller flagged a fault in this generation."""
        if self.store.check([self._fault]):
            raise PeerFailure(f"a peer of generation {self.generation} failed")

    def call(self, fn: Callable[[], object]) -> object:
        """Run blocking ``fn`` on the waiter thread; poll for faults until it returns."""
        pending = self._waiter.submit(fn)
        while not pending.done.wait(POLL_INTERVAL_S):
            self.check()
        if pending.error is not None:
            raise PeerFailure(str(pending.error)) from pending.error
        return pending.result

    def wait(self, *works: dist.Work) -> None:
        """Wait for ``works``, raising :class:`PeerFailure` as soon as a fault is flagged."""
        for work in works:
            if polls_completion(self.backend):
                wait_polled(work, self.check, interval_s=POLL_INTERVAL_S)
            else:
                self.call(work.wait)

    def send(self, tensor: torch.Tensor, device: int, *, tag: int = 0) -> dist.Work:
        return self._post(post_p2p, self.backend, self.world.send, tensor, self.rank_of(device), tag, False)

    def recv(self, tensor: torch.Tensor, device: int, *, tag: int = 0) -> dist.Work:
        return self._post(post_p2p, self.backend, self.world.recv, tensor, self.rank_of(device), tag, True)

    def all_reduce(self, tensor: torch.Tensor, members: tuple[int, ...] | None = None) -> None:
        """In-place sum over ``members`` (default: every device)."""
        group = self.world if members is None else self.group(members)
        self.wait(self._post(group.allreduce, [tensor]))

    def _post(self, op: Callable[..., dist.Work], *args) -> dist.Work:
        """Issue an asynchronous op; a connection a dead peer closed fails it at once, as a peer failure."""
        try:
            return op(*args)
        except RuntimeError as err:
            raise PeerFailure(str(err)) from err

    def abandon(self) -> None:
        """Leave this generation for good: keep it referenced so no destructor blocks on dead peers.

        NCCL and HCCL communicators are aborted too, so no device stays blocked in a dead peer's op.
        """
        ABANDONED.append(self)
        if polls_completion(self.backend):
            abort([self.world, *self._groups.values()])


class _Pending:
    __slots__ = ("fn", "done", "error", "result")

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: object = None


class _Waiter:
    """A daemon thread that runs blocking calls so the main thread never blocks in C++."""

    def __init__(self, *, name: str):
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], object]) -> _Pending:
        pending = _Pending(fn)
        self._queue.put(pending)
        return pending

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                pending.result = pending.fn()
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                pending.error = err
            pending.done.set()
