"""One generation of process groups, built and used so that no fault can wedge a survivor.

Gloo cannot interrupt a blocked collective or connect: ``abort()`` returns but the
blocked call stays blocked until the group's timeout (measured with torch 2.13). So:

- A generation's groups are raw backend objects (``ProcessGroupGloo`` …) on a
  fresh store prefix, outside c10d's global default group: a generation that saw a
  fault is simply abandoned (kept referenced, never destroyed, never reused) and
  the next one is built beside it.
- Every blocking call — connecting the groups, ``Work.wait()`` of a collective or
  point-to-point op — runs in a daemon thread while the main thread polls its
  completion and the fault flag the controller sets in the store. Gloo's
  point-to-point ``Work.is_completed()`` only turns true inside ``wait()``, hence
  the thread rather than polling ``is_completed``.
- Only a real peer failure is a :class:`PeerFailure`: the generation was flagged by
  the controller. When a communication call fails first (a peer's process died and
  its connection closed), the worker waits up to ``confirm_s`` for the controller to
  flag it; if no flag comes, the original error is raised and stops the run.
- NCCL and HCCL mean something else by ``wait()``; their completion is polled as
  they define it (:mod:`chameleon.runtime.completion`).

Devices keep their ids across generations; each generation maps them to ranks.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from chameleon.runtime.beacon import GROUP, NOBODY, Beacon
from chameleon.runtime.errors import ControllerLost
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


def _new_group(
    backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta, host: str | None
) -> dist.ProcessGroup:
    """A raw process group of ``backend`` (gloo, nccl, or a registered plugin such as hccl).

    Gloo binds to ``host`` (this node's address) when given, else to what the hostname resolves to.
    """
    if backend == "gloo":
        if host is None:
            return dist.ProcessGroupGloo(store, rank, size, timeout)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, size, options)
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
        host: the address this node's gloo traffic binds to (None: the hostname's).
        confirm_s: how long a failed communication call waits for the controller to
            flag a peer failure before it counts as an error of its own.
        beacon: where this worker's waits are shown to its agent (optional).
        on_connect: called between connecting the world group and the others (fault injection).

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
        host: str | None = None,
        confirm_s: float = 5.0,
        beacon: Beacon | None = None,
        on_connect: Callable[[], None] | None = None,
    ):
        self.store = store
        self.confirm_s = confirm_s
        self.beacon = beacon
        self.generation = generation
        self.devices = tuple(devices)
        self.me = me
        self.backend = backend
        self._rank = {d: r for r, d in enumerate(self.devices)}
        self._fault = fault_key(generation)
        self._waiter = _Waiter(name=f"chameleon-wait-gen{generation}")
        timeout = timedelta(seconds=timeout_s)
        prefix = f"gen{generation}"

        store_client = self.call(connect_store)
        self.world = self.call(lambda: _new_group(
            backend, dist.PrefixStore(f"{prefix}/world", store_client), self.rank, len(self.devices), timeout, host
        ), waiting_on=GROUP)
        if on_connect is not None:
            on_connect()
        self._groups = {}
        for members in dict.fromkeys(groups):
            if me in members and 1 < len(members) < len(self.devices):  # the world's own set uses the world
                sub_store = dist.PrefixStore(f"{prefix}/group/{'-'.join(map(str, members))}", store_client)
                self._groups[members] = self.call(
                    partial(_new_group, backend, sub_store, members.index(me), len(members), timeout, host),
                    waiting_on=GROUP,
                )

    @property
    def rank(self) -> int:
        return self._rank[self.me]

    def rank_of(self, device: int) -> int:
        return self._rank[device]

    def group(self, members: tuple[int, ...]) -> dist.ProcessGroup:
        """The group over ``members`` (which must include this device and have been declared)."""
        return self.world if len(members) == len(self.devices) else self._groups[members]

    def flagged(self) -> bool:
        """True once the controller flagged a fault in this generation.

        Raises:
            ControllerLost: the controller's store cannot be reached.
        """
        try:
            return self.store.check([self._fault])
        except RuntimeError as err:
            raise ControllerLost("the controller is gone (its store closed the connection)") from err

    def check(self) -> None:
        """Raise :class:`PeerFailure` if the controller flagged a fault in this generation."""
        if self.flagged():
            raise PeerFailure(f"a peer of generation {self.generation} failed")

    def call(self, fn: Callable[[], object], *, waiting_on: int = NOBODY, peer_errors: bool = True) -> object:
        """Run blocking ``fn`` on the waiter thread; poll for faults until it returns.

        ``waiting_on`` is shown on the beacon meanwhile (a peer device, or GROUP). An
        error of ``fn`` is a :class:`PeerFailure` only if the controller flags one
        (waited for up to ``confirm_s`` when ``peer_errors``); otherwise it is raised as is.
        """
        if self.beacon is not None:
            self.beacon.waiting(waiting_on)
        pending = self._waiter.submit(fn)
        try:
            while not pending.done.wait(POLL_INTERVAL_S):
                self.check()
        finally:
            if self.beacon is not None:
                self.beacon.waiting(NOBODY)
        if pending.error is not None:
            self._raise(pending.error, confirm=peer_errors)
        return pending.result

    def wait(self, *works: dist.Work, peer: int = GROUP) -> None:
        """Wait for ``works`` (on ``peer``, for the beacon), raising :class:`PeerFailure` once a fault is flagged."""
        for work in works:
            if not polls_completion(self.backend):
                self.call(work.wait, waiting_on=peer)
                continue
            if self.beacon is not None:
                self.beacon.waiting(peer)
            try:
                wait_polled(work, self.check, interval_s=POLL_INTERVAL_S)
            except RuntimeError as err:
                self._raise(err, confirm=True)
            finally:
                if self.beacon is not None:
                    self.beacon.waiting(NOBODY)

    def send(self, tensor: torch.Tensor, device: int, *, tag: int = 0) -> dist.Work:
        return self._post(post_p2p, self.backend, self.world.send, tensor, self.rank_of(device), tag, False)

    def recv(self, tensor: torch.Tensor, device: int, *, tag: int = 0) -> dist.Work:
        return self._post(post_p2p, self.backend, self.world.recv, tensor, self.rank_of(device), tag, True)

    def all_reduce(self, tensor: torch.Tensor, members: tuple[int, ...] | None = None) -> None:
        """In-place sum over ``members`` (default: every device)."""
        group = self.world if members is None else self.group(members)
        self.wait(self._post(group.allreduce, [tensor]))

    def _post(self, op: Callable[..., dist.Work], *args) -> dist.Work:
        """Issue an asynchronous op; posting to a connection a dead peer closed fails at once."""
        try:
            return op(*args)
        except RuntimeError as err:
            self._raise(err, confirm=True)

    def _raise(self, error: BaseException, *, confirm: bool) -> None:
        """Raise :class:`PeerFailure` if the controller flags this generation (within ``confirm_s``), else ``error``."""
        deadline = time.monotonic() + (self.confirm_s if confirm else 0.0)
        while True:
            if self.flagged():
                raise PeerFailure(f"a peer of generation {self.generation} failed ({error})") from error
            if time.monotonic() >= deadline:
                raise error
            time.sleep(POLL_INTERVAL_S)

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
