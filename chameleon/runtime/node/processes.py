"""A node's worker processes: started, watched, signalled and stopped for its agent.

Workers fork from a forkserver that has already imported torch (started in a
thread of its own: the first start waits seconds for the forkserver, and the
agent's loop must keep answering meanwhile). Each gets a pipe for its reports, a
downlink (a pipe of pushed frames and a shared-memory board:
:mod:`chameleon.runtime.node.downlink`), a lifeline (a pipe whose other end only the
agent holds: when the agent dies, its workers see EOF and exit) and a beacon in
shared memory (:mod:`chameleon.runtime.beacon`). A worker's exit is seen through
its process sentinel, a hang through a heartbeat counter that stopped, a stall
through a progress counter that stood still; both are reported with where the
worker was. A lost worker is restarted after ``failure.rejoin_after_s`` when asked.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from chameleon.config import Config
from chameleon.faults.spec import PACED_KINDS, FaultSpec
from chameleon.runtime.node.beacon import Beacon
from chameleon.runtime.node.downlink import Downlink, board_words
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.messages import Done, Dying, Exited, Flag, Hung
from chameleon.runtime.protocol.position import Position
from chameleon.runtime.protocol.timeouts import Timeouts
from chameleon.runtime.worker.main import WorkerSpec, worker_main


@dataclass
class _Worker:
    process: mp.Process
    conn: Connection
    downlink: Downlink
    lifeline: Connection
    beacon: Beacon
    beat: int = -1
    beat_t: float = field(default_factory=time.monotonic)
    progress: int = -1
    progress_t: float = field(default_factory=time.monotonic)
    t_fault: float | None = None
    hung: bool = False
    done: bool = False


class Processes:
    """The worker processes of one node (see the module doc).

    Args:
        node: the node's index.
        config: the job's config (what every worker receives).
        run_dir: the controller's run directory.
        store_host, store_port: the controller's c10d store (process-group rendezvous).
        node_addr: the address this node's workers bind their process groups to.
        report: delivers a worker's message (decoded) or an :class:`Exited`/:class:`Hung` to the agent.
        greeting: the frames a newly started worker is pushed first (the newest generation).
    """

    def __init__(self, *, node: int, config: Config, run_dir: str, store_host: str, store_port: int,
                 node_addr: str | None, report: Callable[[object], None], greeting: Callable[[], list[bytes]]):
        self.node, self.config, self.run_dir = node, config, run_dir
        self.store_host, self.store_port, self.node_addr = store_host, store_port, node_addr
        self.report, self.greeting = report, greeting
        self.per_node = config.launcher.nproc_per_node
        self.hung_after_s = Timeouts.of(config).hung_s
        self.rejoin_after_s = config.failure.rejoin_after_s
        self.workers: dict[int, _Worker] = {}
        self.spawning: set[int] = set()
        self.faults: dict[int, tuple[FaultSpec, ...]] = {}
        self.restarts: dict[int, tuple[float, int]] = {}  # a lost worker's: when, and the first generation it may join
        self.generation = 0
        self._ctx = forkserver()
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chameleon-spawn")
        self._spawned: queue.SimpleQueue[tuple[int, _Worker]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    # ----- starting -------------------------------------------------------------------------

    def start(self, devices, faults: tuple[FaultSpec, ...]) -> None:
        """Start the workers of ``devices`` (each with its faults); a running one is left alone."""
        for device in devices:
            self.faults[device] = tuple(f for f in faults if f.rank == device or f.node == self.node)
            if device not in self.spawning and (device not in self.workers or not self.workers[device].process.is_alive()):
                self._spawn(device)

    def _spawn(self, device: int, first_generation: int = 0) -> None:
        self.spawning.add(device)
        spec = WorkerSpec(device, self.store_host, self.store_port, self.config, self.run_dir, self.node_addr,
                          self.per_node, self.faults.get(device, ()), first_generation)
        self._spawner.submit(self._launch, spec)

    def _launch(self, spec: WorkerSpec) -> None:
        """Start one worker process (in the spawner thread); the agent's loop picks it up."""
        recv_end, send_end = self._ctx.Pipe(duplex=False)
        down_r, down_w = self._ctx.Pipe(duplex=False)
        lifeline, keep = self._ctx.Pipe(duplex=False)
        beacon, board = Beacon.for_context(self._ctx), board_words(self._ctx)
        proc = self._ctx.Process(target=worker_main, args=(spec, send_end, down_r, lifeline, beacon.words, board),
                                 name=f"chameleon-worker-{spec.device}", daemon=True)
        proc.start()
        for end in (send_end, down_r, lifeline):
            end.close()
        self._spawned.put((spec.device, _Worker(proc, recv_end, Downlink(down_w, board), keep, beacon)))
        os.write(self._wake_w, b"x")

    # ----- the agent's loop ---------------------------------------------------------------------

    def waitables(self) -> list:
        return [self._wake_r] + [w.conn for w in self.workers.values()] + [w.process.sentinel for w in self.workers.values()]

    def on_ready(self, item) -> None:
        """Handle a started worker, a readable worker pipe or a fired sentinel."""
        if item == self._wake_r:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            while not self._spawned.empty():
                device, worker = self._spawned.get()
                self.spawning.discard(device)
                self.workers[device] = worker
                for frame in self.greeting():
                    worker.downlink.push(frame)
            return
        for device, w in list(self.workers.items()):
            if item is w.conn:
                self._relay(device, w)
            elif item == w.process.sentinel:
                self._on_exit(device, w)

    def _relay(self, device: int, w: _Worker) -> None:
        while w.conn.poll():
            try:
                message = codec.decode(w.conn.recv_bytes())
            except (EOFError, OSError):
                return
            if isinstance(message, Dying):
                if message.fault.kind not in PACED_KINDS:  # a slow device lives on: its onset is no time of death
                    w.t_fault = message.t
                self.faults[device] = tuple(f for f in self.faults.get(device, ()) if f != message.fault)
            elif isinstance(message, Done):
                w.done = True
            self.report(message)

    def _on_exit(self, device: int, w: _Worker) -> None:
        self._relay(device, w)  # its last words may say when and where it died
        w.process.join()
        del self.workers[device]
        w.conn.close()
        w.lifeline.close()
        w.downlink.close()
        if w.done and w.process.exitcode == 0:
            return
        if w.t_fault is not None:
            t_fault, source = w.t_fault, "injected or fenced"
        else:  # killed from outside: it was last seen alive at its last heartbeat
            t_fault, source = time.time() - (time.monotonic() - w.beat_t), "last heartbeat"
        self.report(Exited(device, self.generation, w.process.exitcode, w.beacon.position(), t_fault, source))
        if self.rejoin_after_s is not None:  # back only in a generation decided after its loss
            self.restarts[device] = (time.monotonic() + self.rejoin_after_s, self.generation + 1)

    def tick(self) -> None:
        """Pulse every board; find hung workers; note progress; restart lost ones whose re-join time came."""
        now = time.monotonic()
        for device, w in self.workers.items():
            w.downlink.pulse()
            beat, progress = w.beacon.heartbeat, w.beacon.progress
            if progress != w.progress:
                w.progress, w.progress_t = progress, now
            if beat != w.beat:
                w.beat, w.beat_t, w.hung = beat, now, False
            elif not w.hung and now - w.beat_t > self.hung_after_s and _running(w.process.pid):
                w.beat_t = now  # busy, its heartbeat thread starved: not hung
            elif not w.hung and now - w.beat_t > self.hung_after_s:
                w.hung = True
                self.report(Hung(device, self.generation, w.beacon.position(), now - w.beat_t,
                                 time.time() - (now - w.beat_t)))
        for device, (due, first_generation) in list(self.restarts.items()):
            if now >= due:
                del self.restarts[device]
                self._spawn(device, first_generation)

    # ----- orders ---------------------------------------------------------------------------------

    def push(self, message: object, frame: bytes) -> None:
        """Hand a pushed frame to every worker (a flag is marked on their boards once it is in their pipes)."""
        flags = message.generation if isinstance(message, Flag) else None
        for w in self.workers.values():
            w.downlink.push(frame, flags=flags)

    def positions(self) -> dict[int, tuple[Position, float]]:
        """Every worker's position and how long its progress counter has stood still (seconds)."""
        now = time.monotonic()
        return {d: (w.beacon.position(), now - w.progress_t) for d, w in self.workers.items()}

    def signal(self, device: int, signum: int) -> None:
        """Deliver a signal to a worker (fencing, or an injected kill/hang); remember when."""
        w = self.workers.get(device)
        if w is not None and w.process.is_alive():
            w.t_fault = time.time()
            with contextlib.suppress(ProcessLookupError):  # exited and reaped since: its exit is reported as any other
                os.kill(w.process.pid, signum)

    def stop(self, *, grace_s: float) -> None:
        """Let workers exit within ``grace_s``, kill the rest, and reap them all; no restart is pending."""
        self.restarts.clear()
        self._spawner.shutdown(wait=True, cancel_futures=True)
        self.on_ready(self._wake_r)
        deadline = time.monotonic() + grace_s
        for w in self.workers.values():
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in self.workers.values():
            if w.process.is_alive():
                w.process.kill()
            w.process.join()
            w.downlink.close()
        self.workers.clear()


def forkserver(*, start: bool = False, ready: bool = False):
    """The forkserver context workers and the controller's planning process start from (torch, the worker module
    and the planning process's preloaded: a planner ready when training starts).

    ``start`` starts the server now (its imports overlap what comes next); ``ready`` also waits for
    them, so that a worker starts in milliseconds afterwards.
    """
    # Workers report their own failures in one line; c10d's C++ warnings (a stack trace for every
    # connection a dead peer closed) would bury them. The forkserver inherits this at its start.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "chameleon.runtime.worker.main", "chameleon.runtime.control.offload"])
    if start:
        mp.forkserver.ensure_running()
    if ready:  # a no-op child starts once the server has finished its imports
        child = ctx.Process(target=os.getpid, daemon=True)
        child.start()
        child.join()
    return ctx


def stop_forkserver() -> None:
    """Stop the forkserver and multiprocessing's resource tracker, and wait until both have exited.

    Both would leave a moment after this process; a line saying that every process is stopped must be true.
    """
    mp.forkserver._forkserver._stop()
    mp.resource_tracker._resource_tracker._stop()


def _running(pid: int) -> bool:
    """True while the kernel shows the process running or runnable (state R).

    A busy worker whose heartbeat thread is starved (a long call holding the GIL, a
    loaded host) is not hung; a stopped one (T) or one blocked in the kernel with its
    interpreter wedged (S, D) is, once its heartbeat stood still long enough.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"R"
    except (OSError, IndexError):
        return False
