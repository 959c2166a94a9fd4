"""The node agent: starts this node's workers, watches them, and relays what they say.

Every node runs one. On node 0 it lives in the controller's process and reports
in-process; on every other node it is the process that ``python -m chameleon.train
launcher.node_rank=K …`` starts (:func:`serve`), and it talks to the controller over
an authenticated link (:mod:`chameleon.runtime.wire`).

An agent forks its workers from a forkserver that has already imported torch (in a
thread of its own: the first start waits seconds for the forkserver, and the
agent's loop must keep answering meanwhile), hands each a pipe for its reports, a lifeline (a pipe whose other end only the
agent holds: when the agent dies, its workers see EOF and exit) and a beacon in
shared memory. It sees a worker exit through its process sentinel, and a hung one
through a heartbeat counter that stopped; it reports both with where the worker
was. It restarts a lost worker after ``failure.rejoin_after_s`` when asked to.

A remote agent holds a lease: it renews it every ``LEASE_S`` and the controller
answers each renewal. An agent that hears nothing for ``2 · ft.heartbeat_timeout_s``
(it was stopped, or its link was cut) has been declared lost: it kills its own
workers at once (self-fencing), so a stale node can never act in a newer generation,
then registers again as a returning node.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pickle
import queue
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from chameleon.runtime.beacon import Beacon, Position
from chameleon.runtime.faults import FaultSpec, kill_node, stop_and_resume
from chameleon.runtime.launch import SECRET_ENV, host_identity
from chameleon.runtime.messages import (
    Done, Dying, Exited, Hello, Hung, Inject, Lease, Renew, Shutdown, Signal, Start, Welcome,
)
from chameleon.runtime.preflight import store_problem
from chameleon.runtime.wire import AuthError, Link, SecretMismatch, connect
from chameleon.runtime.worker import WorkerSpec, worker_main

TICK_S = 0.01
LEASE_S = 0.1


@dataclass
class _Worker:
    process: mp.Process
    conn: Connection
    lifeline: Connection
    beacon: Beacon
    beat: int = -1
    beat_t: float = field(default_factory=time.monotonic)
    t_fault: float | None = None
    hung: bool = False
    done: bool = False


class Agent:
    """One node's workers (see the module doc).

    Args:
        node: this node's index.
        config: the job's resolved config (what every worker receives).
        run_dir: the controller's run directory (checkpoints live under it unless ``ckpt.dir``).
        store_host, store_port: the controller's c10d store.
        node_addr: the address this node's workers bind their process groups to.
        report: delivers a message to the controller.
    """

    def __init__(self, *, node: int, config: dict, run_dir: str, store_host: str, store_port: int,
                 node_addr: str | None, report: Callable[[object], None]):
        self.node, self.config, self.run_dir = node, config, run_dir
        self.store_host, self.store_port, self.node_addr = store_host, store_port, node_addr
        self.report = report
        launcher = config["launcher"]
        self.nproc_per_node = launcher["nproc_per_node"]
        self.devices = tuple(range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node))
        self.hung_after_s = config["ft"]["heartbeat_timeout_s"]
        self.rejoin_after_s = config["failure"]["rejoin_after_s"]
        self.workers: dict[int, _Worker] = {}
        self.spawning: set[int] = set()
        self.faults: dict[int, tuple[FaultSpec, ...]] = {}
        self.restarts: dict[int, float] = {}
        self.generation = 0
        self._ctx = forkserver()
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chameleon-spawn")
        self._spawned: queue.SimpleQueue[tuple[int, _Worker]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    # ----- workers ----------------------------------------------------------------------

    def start(self, order: Start) -> None:
        """Start the workers of ``order.devices`` (each with its faults); a running one is left alone."""
        for device in order.devices:
            self.faults[device] = tuple(f for f in order.faults if f.rank == device or f.node == self.node)
            if device not in self.spawning and (device not in self.workers or not self.workers[device].process.is_alive()):
                self._spawn(device)

    def _spawn(self, device: int) -> None:
        self.spawning.add(device)
        spec = WorkerSpec(device, self.store_host, self.store_port, self.config, self.run_dir, self.node_addr,
                          self.nproc_per_node, self.faults.get(device, ()), os.getpid())
        self._spawner.submit(self._launch, spec)

    def _launch(self, spec: WorkerSpec) -> None:
        """Start one worker process (in the spawner thread); the agent's loop picks it up."""
        recv_end, send_end = self._ctx.Pipe(duplex=False)
        lifeline, keep = self._ctx.Pipe(duplex=False)
        beacon = Beacon.for_context(self._ctx)
        proc = self._ctx.Process(target=worker_main, args=(spec, send_end, lifeline, beacon.words),
                                 name=f"chameleon-worker-{spec.device}", daemon=True)
        proc.start()
        send_end.close()
        lifeline.close()
        self._spawned.put((spec.device, _Worker(proc, recv_end, keep, beacon)))
        os.write(self._wake_w, b"x")

    def waitables(self) -> list:
        return [self._wake_r] + [w.conn for w in self.workers.values()] + [w.process.sentinel for w in self.workers.values()]

    def on_ready(self, item) -> None:
        """Handle a started worker, a readable worker pipe or a fired sentinel."""
        if item == self._wake_r:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
            while not self._spawned.empty():
                device, worker = self._spawned.get()
                self.spawning.discard(device)
                self.workers[device] = worker
            return
        for device, w in list(self.workers.items()):
            if item is w.conn:
                self._relay(device, w)
            elif item == w.process.sentinel:
                self._on_exit(device, w)

    def _relay(self, device: int, w: _Worker) -> None:
        while w.conn.poll():
            try:
                message = pickle.loads(w.conn.recv_bytes())
            except (EOFError, OSError):
                return
            if isinstance(message, Dying):
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
        if w.done and w.process.exitcode == 0:
            return
        if w.t_fault is not None:
            t_fault, source = w.t_fault, "injected or fenced"
        else:  # killed from outside: it was last seen alive at its last heartbeat
            t_fault, source = time.time() - (time.monotonic() - w.beat_t), "last heartbeat"
        self.report(Exited(device, self.generation, w.process.exitcode, w.beacon.position(), t_fault, source))
        if self.rejoin_after_s is not None:
            self.restarts[device] = time.monotonic() + self.rejoin_after_s

    def tick(self) -> None:
        """Find hung workers; restart lost ones whose re-join time came."""
        now = time.monotonic()
        for device, w in self.workers.items():
            beat = w.beacon.heartbeat
            if beat != w.beat:
                w.beat, w.beat_t, w.hung = beat, now, False
            elif not w.hung and now - w.beat_t > self.hung_after_s and _running(w.process.pid):
                w.beat_t = now  # busy, its heartbeat thread starved: not hung
            elif not w.hung and now - w.beat_t > self.hung_after_s:
                w.hung = True
                self.report(Hung(device, self.generation, w.beacon.position(), now - w.beat_t,
                                 time.time() - (now - w.beat_t)))
        for device, due in list(self.restarts.items()):
            if now >= due:
                del self.restarts[device]
                self._spawn(device)

    def positions(self) -> dict[int, tuple[Position, int]]:
        """Every worker's position and progress counter."""
        return {d: (w.beacon.position(), w.beacon.progress) for d, w in self.workers.items()}

    def signal(self, order: Signal) -> None:
        """Deliver a signal to a worker (fencing, or an injected kill/hang); remember when."""
        w = self.workers.get(order.device)
        if w is not None and w.process.is_alive():
            w.t_fault = time.time()
            with contextlib.suppress(ProcessLookupError):  # exited and reaped since: its exit is reported as any other
                os.kill(w.process.pid, order.signum)

    def inject(self, order: Inject) -> None:
        """Fire a fault from outside its victim: a worker's kill or hang, or this node's kill or hang."""
        f = order.fault
        if f.kind in ("kill", "hang"):
            self.signal(Signal(order.generation, f.rank, signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP,
                               f.describe()))
        elif f.kind == "node_kill":
            kill_node(os.getpid())
        elif f.kind == "node_hang":
            stop_and_resume(os.getpid(), f.resume_after_s)

    def obey(self, order: object) -> None:
        """Carry out a controller's order (Start, Signal, Inject, Renew; Shutdown is the caller's)."""
        self.generation = max(self.generation, getattr(order, "generation", self.generation))
        if isinstance(order, Start):
            self.start(order)
        elif isinstance(order, Signal):
            self.signal(order)
        elif isinstance(order, Inject):
            self.inject(order)
        elif not isinstance(order, Renew):
            raise TypeError(f"unexpected message from the controller: {order!r}")

    def stop(self, *, grace_s: float) -> None:
        """Let workers exit within ``grace_s``, kill the rest; none is left behind; no restart is pending."""
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
        self.workers.clear()


def forkserver(*, start: bool = False, ready: bool = False):
    """The forkserver context workers start from (torch and the worker module preloaded).

    ``start`` starts the server now (its imports overlap what comes next); ``ready`` also waits for
    them, so that a worker starts in milliseconds afterwards.
    """
    # Workers report their own failures in one line; c10d's C++ warnings (a stack trace for every
    # connection a dead peer closed) would bury them. The forkserver inherits this at its start.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "chameleon.runtime.worker"])
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


def serve(config: dict, *, node: int, master_addr: str, control_port: int, key: bytes, node_addr: str | None,
          join_timeout_s: float) -> int:
    """Run node ``node``'s agent until the job ends; return the process's exit code.

    Registers with the controller, starts the workers it is given, relays, renews
    its lease; fences and registers again after losing the controller's contact.
    SIGTERM is ignored: on preemption the controller saves a checkpoint and ends the job.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    forkserver(start=True, ready=True)  # register only once workers can start at once
    returning, lease_s = False, 2 * config["ft"]["heartbeat_timeout_s"]
    deadline = time.monotonic() + join_timeout_s
    while True:
        try:
            link = connect(master_addr, control_port, key)
        except SecretMismatch as err:
            print(f"chameleon agent {node}: refused: {err}: set the same {SECRET_ENV} on every node", file=sys.stderr,
                  flush=True)
            return 2
        except AuthError as err:
            print(f"chameleon agent {node}: no Chameleon controller answers at {master_addr}:{control_port} ({err}): "
                  "check launcher.master_addr and launcher.control_port", file=sys.stderr, flush=True)
            return 2
        except OSError as err:
            if returning and isinstance(err, ConnectionRefusedError):  # it answered before; nothing listens there now
                print(f"chameleon agent {node}: the job has ended (its controller at {master_addr}:{control_port} is "
                      "gone)", file=sys.stderr, flush=True)
                return 0
            if time.monotonic() > deadline:
                print(f"chameleon agent {node}: no controller at {master_addr}:{control_port} within "
                      f"{join_timeout_s:.0f} s ({err}): start node 0 first, or check launcher.master_addr/master_port",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
            continue
        problem = None if returning else store_problem(master_addr, config["launcher"]["master_port"])
        if problem:
            link.close()
            print(f"chameleon agent {node}: {problem}", file=sys.stderr, flush=True)
            return 2
        link.send(Hello(node, _devices(config, node), os.getpid(), node_addr or socket.gethostname(), host_identity(),
                        config, returning=returning))
        try:
            reply = link.recv() if link.poll(join_timeout_s) else None
        except (EOFError, OSError):  # the controller's process ended first
            print(f"chameleon agent {node}: the job has ended (its controller at {master_addr}:{control_port} closed "
                  "the link before admitting this node)", file=sys.stderr, flush=True)
            return 0 if returning else 1
        if not isinstance(reply, Welcome):
            why = reply.why if isinstance(reply, Shutdown) else "no answer"
            print(f"chameleon agent {node}: not admitted: {why}", file=sys.stderr, flush=True)
            return 2
        outcome = _relay(link, reply, node=node, master_addr=master_addr, node_addr=node_addr, lease_s=lease_s)
        if outcome == "shutdown":
            return 0
        print(f"chameleon agent {node}: {outcome}; my workers are stopped, registering again", file=sys.stderr, flush=True)
        returning, deadline = True, time.monotonic() + join_timeout_s


def _devices(config: dict, node: int) -> tuple[int, ...]:
    per = config["launcher"]["nproc_per_node"]
    return tuple(range(node * per, (node + 1) * per))


def _relay(link: Link, welcome: Welcome, *, node: int, master_addr: str, node_addr: str | None, lease_s: float) -> str:
    """Serve one admission: until Shutdown ("shutdown") or the contact is lost (why); workers are stopped either way."""
    lost: list[str] = []

    def report(message: object) -> None:
        try:
            link.send(message)
        except OSError as err:
            lost.append(f"the link to the controller broke ({err})")

    agent = Agent(node=node, config=welcome.config, run_dir=welcome.run_dir, store_host=master_addr,
                  store_port=welcome.store_port, node_addr=node_addr, report=report)
    agent.generation = welcome.generation
    agent.start(welcome.start)
    renewed = sent = time.monotonic()
    outcome = None
    try:
        while outcome is None:
            if lost:
                outcome = lost[0]
            elif time.monotonic() - renewed > lease_s:  # first thing after a stop: never act on a lapsed lease
                outcome = f"my lease lapsed ({time.monotonic() - renewed:.1f} s without the controller)"
            else:
                outcome, renewed = _serve_once(link, agent, renewed)
                agent.tick()
                if outcome is None and time.monotonic() - sent >= LEASE_S:
                    sent = time.monotonic()
                    report(Lease(node, agent.generation, agent.positions()))
    finally:  # Ctrl-C included
        agent.stop(grace_s=0.0)  # fencing kills at once; after a Shutdown the workers are already stopped
        link.close()
    return outcome


def _serve_once(link: Link, agent: Agent, renewed: float) -> tuple[str | None, float]:
    """One wait: relay workers, obey the controller; returns (outcome if the admission ended, lease renewal time)."""
    for item in wait([link, *agent.waitables()], timeout=TICK_S):
        if item is not link:
            agent.on_ready(item)
            continue
        try:
            order = link.recv()
        except (EOFError, OSError, AuthError) as err:
            return f"lost the controller ({str(err) or 'closed'})", renewed
        if isinstance(order, Shutdown):
            agent.stop(grace_s=order.grace_s)
            return "shutdown", renewed
        renewed = time.monotonic()
        agent.obey(order)
    return None, renewed
