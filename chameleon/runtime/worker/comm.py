"""One generation of process groups, built and used so that no fault can wedge a survivor.

Gloo cannot interrupt a blocked collective or connect: ``abort()`` returns but the
blocked call stays blocked until the group's timeout (measured with torch 2.13). So:

- A generation's groups are raw backend objects (``ProcessGroupGloo`` …) on a
  fresh store prefix, outside c10d's global default group: a generation that saw a
  fault is abandoned (never reused; its destructors never run on the main thread) and
  the next one is built beside it. Gloo's groups are let go on a side thread once
  their calls under way have returned, so no connection to a dead peer stays open
  (one keeps gloo's event loop spinning); NCCL's and HCCL's are aborted (below). A generation left in good order (a growth's
  switch at a commit: every op of every group completed) hands its groups to the
  next, which keeps those whose members are unchanged.
- No wait ignores faults. The fault flag is what the node agent writes into the worker's
  shared board (:mod:`chameleon.runtime.node.downlink`): checking it is a memory read,
  never a network round trip. A gloo collective is waited for on the main thread in
  timed slices with a check between them (:class:`~chameleon.runtime.worker.completion.Collective`);
  every other blocking call — connecting the groups, ``Work.wait()`` of a point-to-point
  op — runs in a daemon thread while the main thread polls its completion and the
  flag. Gloo's point-to-point ``Work.is_completed()`` only turns true inside ``wait()``,
  and a timed-out wait closes its pair, hence the thread.
- Only a real peer failure is a :class:`PeerFailure`: the generation was flagged by
  the controller. When a communication call fails first (a peer's process died and
  its connection closed), the worker waits up to ``confirm_s`` for the controller to
  flag it; if no flag comes, the original error is raised and stops the run.
- NCCL and HCCL mean something else by ``wait()``; their completion is polled as
  they define it, under error handling Chameleon sets, not the library's default
  (:mod:`chameleon.runtime.worker.completion`). Their communicators are built eagerly and
  non-blocking, on the waiter thread.
- Sends and receives go in batches (:meth:`Generation.exchange`): on a backend that
  coalesces (NCCL, HCCL), a pair's sends and receives are one group call, as NCCL
  requires of two devices that send to each other.
- Leaving a broken generation aborts its communicators on a side thread, within
  ``abort_s``; an abort that does not return fences the device (:class:`DeviceFault`):
  it is replaced as a lost device, its state recovered from replicas.

Devices keep their ids across generations; in a group, ranks follow device order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from chameleon.runtime.node.beacon import Beacon
from chameleon.runtime.protocol.errors import DeviceFault
from chameleon.runtime.protocol.position import GROUP, NOBODY
from chameleon.runtime.worker.completion import Collective, abort, polls_completion, post_p2p, wait_polled

POLL_INTERVAL_S = 0.002  # fault-flag checks (a shared-memory read) while waiting; completion wakes the wait at once
ABANDONED: list[Generation] = []  # broken generations stay referenced: their destructors would block


class PeerFailure(RuntimeError):
    """A peer of this generation failed; the in-flight work must be abandoned."""


def group_prefix(generation: int, members: tuple[int, ...]) -> str:
    """The store prefix under which ``members`` rendezvous for their group of ``generation``.

    The store serves process-group rendezvous only, and these prefixes are its only keys
    (each backend writes its own rendezvous values under them).
    """
    return f"gen{generation}/group/{'-'.join(map(str, members))}"


def connect_store(host: str, port: int, *, timeout_s: float) -> dist.Store:
    """A client of the controller's TCPStore, counting this process's operations (:func:`store_ops`)."""
    return CountedStore(dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                      wait_for_workers=False))


_OPS = [0]


def store_ops() -> int:
    """Store operations this process has made through :func:`connect_store`'s clients (every group's rendezvous)."""
    return _OPS[0]


class CountedStore(dist.Store):
    """A store that forwards every operation to ``inner`` and counts it; the backends' own rendezvous goes through
    it too (a Python store is called back from C++)."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner = inner

    def set(self, key, value):
        _OPS[0] += 1
        return self.inner.set(key, value)

    def get(self, key):
        _OPS[0] += 1
        return self.inner.get(key)

    def add(self, key, value):
        _OPS[0] += 1
        return self.inner.add(key, value)

    def check(self, keys):
        _OPS[0] += 1
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        _OPS[0] += 1
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        _OPS[0] += 1
        return self.inner.delete_key(key)

    def wait(self, keys, timeout=None):
        _OPS[0] += 1
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def num_keys(self):
        _OPS[0] += 1
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def build_group(
    backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta, host: str | None, device: torch.device
) -> dist.ProcessGroup:
    """A raw process group of ``backend`` (gloo, nccl, or a registered plugin such as hccl), connected.

    Gloo binds to ``host`` (this node's address) when given, else to what the hostname resolves to.
    NCCL's communicator is non-blocking (``config.blocking=0``: its init returns while it runs, and
    the first op waits for it, within ``timeout``) and built now, on ``device``, not at the first op.
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
        options.config.blocking = 0
        group = dist.ProcessGroupNCCL(store, rank, size, options)
        group.eager_connect_single_device(device)
        return group
    return _plugin_group(backend, store, rank, size, timeout)


def _plugin_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A group of a registered plugin backend (torch-npu's hccl), called in the shape the plugin registered:
    ``(store, rank, size, timeout)``, or with ``extended_api`` one ``_DistributedBackendOptions`` and no options."""
    plugin = dist.Backend._plugins[backend.upper()]
    if not plugin.extended_api:
        return plugin.creator_fn(store, rank, size, timeout)
    options = dist.distributed_c10d._DistributedBackendOptions()
    options.store, options.group_rank, options.group_size, options.timeout = store, rank, size, timeout
    options.group_id, options.global_ranks_in_group = f"chameleon-{backend}", list(range(size))
    return plugin.creator_fn(options, None)


class Generation:
    """The process groups of one generation and fault-aware waits on them.

    Only the groups the plan uses are built: one per gradient-sync bucket and TP
    stage, and one per pair of devices that exchange activations or state (no
    world group: gloo's full mesh over every member would cost each rank a
    connection per member, and the store a rendezvous quadratic in them). Every
    device builds the groups it belongs to in the one order all share (sorted),
    so no two devices can wait on each other's groups in a cycle.

    Args:
        connect_store: opens a fresh client of the controller's store for this
            generation's rendezvous: a rendezvous blocked on a dead peer then holds
            only its own connection.
        generation: generation number; names the store prefix of its groups.
        me: this worker's device id.
        backend: ``gloo``, ``nccl`` or ``hccl``.
        timeout_s: backend timeout; never reached on a fault, which is polled instead.
        groups: every group of the generation (device tuples); only members build one.
        flagged: True once the controller flagged this generation broken (a read of
            the worker's shared board: no network round trip).
        host: the address this node's gloo traffic binds to (None: the hostname's).
        confirm_s: how long a failed communication call waits for the controller to
            flag a peer failure before it counts as an error of its own.
        beacon: where this worker's waits are shown to its agent (optional).
        reuse: the previous generation, left in good order (a growth's switch), whose
            groups with the same members are kept instead of rebuilt.
        on_connect: called after the first group connects (fault injection).
        device: this worker's device (NCCL binds its communicators to it; batches are coalesced on it).
        abort_s: how long aborting a broken generation's communicators may take before this
            device fences itself (``ft.abort_timeout_s``).

    Raises:
        PeerFailure: when the controller flags a fault before the groups connect.
    """

    def __init__(
        self,
        *,
        connect_store: Callable[[], dist.Store],
        generation: int,
        me: int,
        backend: str,
        timeout_s: float,
        groups: Sequence[tuple[int, ...]] = (),
        flagged: Callable[[], bool] = lambda: False,
        host: str | None = None,
        confirm_s: float = 5.0,
        beacon: Beacon | None = None,
        reuse: Generation | None = None,
        on_connect: Callable[[], None] | None = None,
        device: torch.device = torch.device("cpu"),
        abort_s: float = 10.0,
    ):
        self.confirm_s, self.abort_s, self.device = confirm_s, abort_s, device
        self.beacon = beacon
        self.generation = generation
        self.me = me
        self.backend = backend
        self._flagged = flagged
        self._waiter = _Waiter(name=f"chameleon-wait-gen{generation}")
        timeout = timedelta(seconds=timeout_s)
        kept = reuse._groups if reuse is not None else {}
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.built = 0
        store_client = None
        for members in sorted({tuple(sorted(g)) for g in groups if me in g and len(set(g)) > 1}):
            if members in kept:
                self._groups[members] = kept[members]
                continue
            if store_client is None:
                store_client = self.call(connect_store)
            sub_store = dist.PrefixStore(group_prefix(generation, members), store_client)
            self._groups[members] = self.call(
                partial(build_group, backend, sub_store, members.index(me), len(members), timeout, host, device),
                waiting_on=GROUP,
            )
            self.built += 1
            if on_connect is not None:
                on_connect()
                on_connect = None
        if on_connect is not None:
            on_connect()

    def group(self, members: tuple[int, ...]) -> dist.ProcessGroup:
        """The group over ``members`` (sorted; it must include this device and have been declared)."""
        return self._groups[members]

    def _pair(self, device: int) -> tuple[dist.ProcessGroup, int]:
        """The group of this device and ``device``, and ``device``'s rank in it."""
        members = (self.me, device) if self.me < device else (device, self.me)
        return self._groups[members], members.index(device)

    def flagged(self) -> bool:
        """True once the controller flagged a fault in this generation."""
        return self._flagged()

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

    def wait(self, *works: dist.Work | Collective, peer: int = GROUP) -> None:
        """Wait for ``works`` (on ``peer``, for the beacon), raising :class:`PeerFailure` once a fault is flagged."""
        for work in works:
            if isinstance(work, Collective):
                self._wait_here(partial(work.wait, self.check, interval_s=POLL_INTERVAL_S), peer)
            elif polls_completion(self.backend):
                self._wait_here(partial(wait_polled, work, self.check, interval_s=POLL_INTERVAL_S), peer)
            else:
                self.call(work.wait, waiting_on=peer)

    def _wait_here(self, wait: Callable[[], None], peer: int) -> None:
        """``wait()`` on this thread (it checks for faults itself), shown on the beacon as waiting on ``peer``."""
        if self.beacon is not None:
            self.beacon.waiting(peer)
        try:
            wait()
        except RuntimeError as err:
            self._raise(err, confirm=True)
        finally:
            if self.beacon is not None:
                self.beacon.waiting(NOBODY)

    def send(self, tensor: torch.Tensor, device: int, *, tag: int = 0) -> dist.Work:
        group, rank = self._pair(device)
        return self._post(post_p2p, self.backend, group.send, tensor, rank, tag, False)

    def recv(self, tensor: torch.Tensor, device: int, *, tag: int = 0) -> dist.Work:
        group, rank = self._pair(device)
        return self._post(post_p2p, self.backend, group.recv, tensor, rank, tag, True)

    def exchange(self, sends: Mapping[int, torch.Tensor], receives: Mapping[int, torch.Tensor], *, tag: int = 0) -> None:
        """Send ``sends[d]`` to and receive ``receives[d]`` from each device ``d`` as one batch per peer
        (:meth:`post_batch`); wait for all of it."""
        works: list[tuple[dist.Work, int]] = []
        for peer in sorted({*sends, *receives}):
            posted_sends, posted_receives = self.post_batch(
                peer, sends=[(sends[peer], tag)] if peer in sends else (),
                receives=[(receives[peer], tag)] if peer in receives else ())
            works += [(work, peer) for work in (*posted_sends, *posted_receives)]
        for work, peer in works:
            self.wait(work, peer=peer)

    def post_batch(self, peer: int, *, sends: Sequence[tuple[torch.Tensor, int]] = (),
                   receives: Sequence[tuple[torch.Tensor, int]] = ()) -> tuple[list[dist.Work], list[dist.Work]]:
        """Post sends to and receives from ``peer`` (``(tensor, tag)`` each) as one batch: the works of its sends
        alone, and those that complete its receives.

        On a backend that coalesces (NCCL, HCCL) the batch is one group call, so two devices that send
        to each other cannot deadlock on unmatched sends (one work completes it all); gloo's ops are
        posted one by one.
        """
        group, rank = self._pair(peer)
        ops = [(group.send, t, tag, False) for t, tag in sends] + [(group.recv, t, tag, True) for t, tag in receives]
        if not group.supports_coalescing:
            works = [self._post(post_p2p, self.backend, op, t, rank, tag, receive) for op, t, tag, receive in ops]
            return works[:len(sends)], works[len(sends):]
        group._start_coalescing(self.device)
        for op, t, tag, _ in ops:
            self._post(op, [t], rank, tag)
        return [], [self._post(group._end_coalescing, self.device)]

    def all_reduce(self, tensor: torch.Tensor, members: tuple[int, ...]) -> None:
        """In-place sum over ``members`` (device ids in any order, a declared group)."""
        self.wait(self.post_all_reduce(tensor, members))

    def post_all_reduce(self, tensor: torch.Tensor, members: tuple[int, ...]) -> dist.Work | Collective:
        """Start :meth:`all_reduce`; :meth:`wait` for the work it returns."""
        work = self._post(self.group(tuple(sorted(members))).allreduce, [tensor])
        return work if polls_completion(self.backend) else Collective(work)

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

    def abandon(self, *, before_abort: Callable[[], None] = lambda: None) -> None:
        """Leave this generation for good, on a side thread, so no destructor blocks the main thread on dead peers.

        NCCL and HCCL communicators are aborted (``ncclCommAbort`` can block when a peer cannot abort
        too) and stay referenced; gloo's cannot be interrupted, so its groups are let go once their
        calls have returned (:meth:`_release`). ``before_abort`` runs on that thread first (fault injection).

        Raises:
            DeviceFault: the abort did not return within ``abort_s``; this device's communication
                state is unknown, so it fences itself and is replaced as a lost device.
        """
        ABANDONED.append(self)
        polled = polls_completion(self.backend)
        groups = list(self._groups.values()) if polled else []
        aborted = threading.Event()

        def run() -> None:
            before_abort()
            abort(groups)
            aborted.set()
            if not polled:
                self._release()

        threading.Thread(target=run, name=f"chameleon-abort-gen{self.generation}", daemon=True).start()
        if not aborted.wait(self.abort_s):
            raise DeviceFault(f"aborting generation {self.generation}'s communicators did not return within "
                              f"{self.abort_s:g} s (ft.abort_timeout_s): this device fences itself")

    def retire(self, successor: Generation) -> None:
        """Leave this generation in good order for ``successor`` (built with ``reuse=self``: every member switched at
        the same step boundary, nothing in flight): the groups it does not keep are shut down on a side thread
        (NCCL/HCCL: their communicators flushed and destroyed, their device memory freed; gloo: connections closed)
        and let go. Nothing waits for it: a shutdown that blocks holds only its own thread."""
        kept = {id(group) for group in successor._groups.values()}
        retired = [group for group in self._groups.values() if id(group) not in kept]
        self._groups.clear()

        def run() -> None:
            self._waiter.submit(lambda: None).done.wait()  # its last call's work lets its group go
            for group in retired:
                group.shutdown()
            retired.clear()

        threading.Thread(target=run, name=f"chameleon-retire-gen{self.generation}", daemon=True).start()

    def _release(self) -> None:
        """Gloo: once the calls under way have returned (a dead peer's error, or the group's timeout), let this
        generation's groups go, on this side thread, so their connections close: a connection left open to a dead
        peer keeps gloo's event loop busy, a core's worth of CPU on this device for the rest of the run."""
        self._waiter.submit(lambda: None).done.wait()
        self._groups.clear()
        ABANDONED.remove(self)


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
            pending.fn = None  # the call and what it holds (a work and its tensor) go now, not with the next call
            pending.done.set()
