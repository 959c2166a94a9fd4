"""The node agent: one per node, between the controller and the node's workers.

Every node runs one. On node 0 it lives in the controller's process and reports
in-process; on every other node it is the process that ``python -m chameleon.train
launcher.node_rank=K …`` starts (:func:`serve`), and it talks to the controller over
an authenticated link (:mod:`chameleon.runtime.node.wire`).

Upwards it *aggregates*: the controller hears once per node when every member of
a generation on it is ready (:class:`NodeReady`), when every trainer synced a
step (:class:`NodeSynced`: their losses summed, their samples merged, their parts
of the squared gradient norm summed in device order) and when every checkpoint
writer saved (:class:`NodeSaved`), so what reaches node 0 per step grows with
nodes, not devices. Rare events go up as they are: exits, hangs, errors, returns.
Downwards it *pushes*: every generation, start, commit and fault flag the
controller sends is handed, unchanged, to each worker (:mod:`chameleon.runtime.node.downlink`).

Its workers are a pool with a small interface (start, push, signal, positions,
stop): real processes (:class:`chameleon.runtime.node.processes.Processes`), or the
control-plane benchmark's emulated ones. A worker's announcement of a node fault
is relayed first; the agent fires it once the controller has :class:`Noted` it.

A remote agent holds a lease: anything it sends renews it, and it sends a
:class:`Lease` when it has said nothing for ``lease_s``; anything the controller
sends renews the agent's contact. An agent that hears nothing for
``2 · ft.heartbeat_timeout_s`` (it was stopped, or its link was cut) has been
declared lost: it kills its own workers at once (self-fencing), so a stale node
can never act in a newer generation, then registers again as a returning node.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Protocol

from chameleon.config import Config
from chameleon.faults.inject import kill_node, stop_and_resume
from chameleon.faults.spec import PACED_KINDS, FaultSpec
from chameleon.runtime.node.launch import SECRET_ENV, host_identity
from chameleon.runtime.node.preflight import store_problem
from chameleon.runtime.node.wire import AuthError, Link, SecretMismatch, connect
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.errors import ExitCode
from chameleon.runtime.protocol.messages import (
    PUSHED,
    CheckpointSaved,
    Dying,
    End,
    Evaluated,
    Flag,
    GenerationSpec,
    Hello,
    Inject,
    Lease,
    NodeEvaluated,
    NodeReady,
    NodeSaved,
    NodeSynced,
    Noted,
    Positions,
    Probe,
    Publish,
    Ready,
    Renew,
    Shutdown,
    Signal,
    Start,
    Synced,
    Welcome,
)
from chameleon.runtime.protocol.position import Position
from chameleon.runtime.protocol.timeouts import Timeouts

TICK_S = 0.01


class Pool(Protocol):
    """An agent's workers (real processes, or the benchmark's emulated ones)."""

    generation: int

    def start(self, devices, faults: tuple[FaultSpec, ...]) -> None: ...

    def push(self, message: object, frame: bytes) -> None: ...

    def signal(self, device: int, signum: int) -> None: ...

    def positions(self) -> dict[int, tuple[Position, float]]: ...


@dataclass
class _Generation:
    """What this node aggregates of one generation: its members, trainers and writers here, and their reports."""

    spec: GenerationSpec
    members: frozenset[int]
    trainers: tuple[int, ...]
    ready: set
    synced: dict
    evaluated: dict


class Agent:
    """One node's protocol end (see the module doc).

    Args:
        node: this node's index.
        devices: its devices.
        report: delivers a message to the controller.
        pool: its workers; set once built (it calls back into :meth:`from_worker`).
    """

    def __init__(self, *, node: int, devices: tuple[int, ...], report: Callable[[object], None], pool: Pool | None = None):
        self.node, self.devices, self.report, self.pool = node, devices, report, pool
        self.generation = -1
        self.current: _Generation | None = None
        self.latest: bytes | None = None  # the newest Publish frame, for workers that start later
        self.writers: dict[int, frozenset[int]] = {}  # per generation, its checkpoint writers on this node
        self.saved: dict[tuple[int, int], set[int]] = {}
        self.dying: dict[int, Dying] = {}  # node faults announced, waiting to be noted

    def greeting(self) -> list[bytes]:
        """What a worker that starts now is pushed first: the newest generation."""
        return [self.latest] if self.latest is not None else []

    # ----- the controller's orders and pushes ------------------------------------------------

    def obey(self, order: object, frame: bytes | None = None) -> None:
        """Carry out a controller's message (``frame``: its encoding, forwarded unchanged to workers when pushed).

        Shutdown is the caller's (it ends the agent).
        """
        self.generation = max(self.generation, getattr(order, "generation", self.generation))
        self.pool.generation = self.generation
        match order:
            case Publish(spec=spec):
                mine = frozenset(d for d in self.devices if d in spec.device_set)
                trainers = tuple(d for d in self.devices if d in mine and d in spec.plan.device_set)
                self.current = _Generation(spec, mine, trainers, set(), {}, {})
                self.writers[spec.generation] = frozenset(d for d in spec.writers if d in mine)
                for old in [g for g in self.writers if g < spec.generation - 2]:
                    del self.writers[old]
                frame = frame or codec.encode(order)
                self.latest = frame
                self.pool.push(order, frame)
            case Flag(generation=g):
                if self.current is not None and self.current.spec.generation == g:
                    self.current = None  # nothing of a broken generation is reported any more
                self.pool.push(order, frame or codec.encode(order))
            case _ if isinstance(order, PUSHED):
                self.pool.push(order, frame or codec.encode(order))
            case Start():
                self.pool.start(order.devices, order.faults)
            case Signal():
                self.pool.signal(order.device, order.signum)
            case Inject():
                self.inject(order)
            case Probe():
                self.report(Positions(self.node, order.probe, self.pool.positions()))
            case Noted():
                dying = self.dying.pop(order.device, None)
                if dying is not None:
                    self._fire_node_fault(dying.fault)
            case Renew():
                pass  # its arrival renewed the lease (_serve_once); nothing else to do
            case _:
                raise TypeError(f"unexpected message from the controller: {order!r}")

    def inject(self, order: Inject) -> None:
        """Fire a fault from outside its victim: a worker's kill or hang (a signal), slowness (told to the worker),
        or this node's kill or hang."""
        fault = order.fault
        if fault.kind in ("kill", "hang"):
            self.pool.signal(fault.rank, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        elif fault.kind in PACED_KINDS:
            self.pool.push(order, codec.encode(order))
        else:
            self._fire_node_fault(fault)

    def _fire_node_fault(self, fault: FaultSpec) -> None:
        if fault.kind == "node_kill":
            kill_node(os.getpid())
        elif fault.kind == "node_hang":
            stop_and_resume(os.getpid(), fault.resume_after_s)

    # ----- the workers' reports ----------------------------------------------------------------

    def from_worker(self, message: object) -> None:
        """A worker's message: aggregate it into the node's report, or relay it as it is."""
        current = self.current
        match message:
            case Ready(device=d, generation=g) if current is not None and g == current.spec.generation:
                current.ready.add(d)
                if current.ready >= current.members:
                    self.report(NodeReady(self.node, g, tuple(sorted(current.members))))
            case Ready():
                pass  # of a generation already superseded
            case Synced(device=d, generation=g, step=step) if current is not None and g == current.spec.generation:
                book = current.synced.setdefault(step, {})
                book[d] = (message, time.time())
                if len(book) == len(current.trainers):
                    del current.synced[step]
                    self.report(_node_synced(self.node, g, step, [book[t] for t in current.trainers]))
            case Synced():
                pass  # of a generation already superseded
            case Evaluated(device=d, generation=g, step=step) if current is not None and g == current.spec.generation:
                book = current.evaluated.setdefault(step, {})
                book[d] = message.loss_sum
                if len(book) == len(current.trainers):
                    del current.evaluated[step]
                    self.report(NodeEvaluated(self.node, g, step, current.trainers,
                                              sum(book[t] for t in current.trainers)))
            case Evaluated():
                pass  # of a generation already superseded
            case CheckpointSaved(device=d, generation=g, step=step):
                writers = self.writers.get(g)
                if writers is None:
                    return
                saved = self.saved.setdefault((g, step), set())
                saved.add(d)
                if saved >= writers:
                    del self.saved[(g, step)]
                    self.report(NodeSaved(self.node, g, step, tuple(sorted(writers))))
            case Dying(fault=fault) if fault.kind in ("node_kill", "node_hang"):
                self.dying[message.device] = message
                self.report(message)
            case _:
                self.report(message)


def _node_synced(node: int, generation: int, step: int, reports: list[tuple[Synced, float]]) -> NodeSynced:
    """The node's trainers' reports of a step, in device order, as one."""
    norms = [s.norm_sq for s, _ in reports if s.norm_sq is not None]
    norm = sum(norms) if norms else None  # in device order: every run sums the same way
    samples = tuple(sorted(r for s, _ in reports for r in s.samples))
    return NodeSynced(node, generation, step, tuple(s.device for s, _ in reports), sum(s.loss_sum for s, _ in reports),
                      samples, max(s.compute_s for s, _ in reports), norm, max(t for _, t in reports),
                      tuple(s.device for s, _ in reports if not s.finite),
                      tuple((s.device, s.digest) for s, _ in reports if s.digest is not None),
                      tuple((s.device, s.busy_s) for s, _ in reports))


# ----- a remote node's agent process ------------------------------------------------------------


def serve(config: Config, *, node: int, master_addr: str, control_port: int, key: bytes, node_addr: str | None,
          join_timeout_s: float) -> int:
    """Run node ``node``'s agent until the job ends; return the process's exit code.

    Registers with the controller, starts the workers it is given, relays, renews
    its lease; fences and registers again after losing the controller's contact.
    It exits with the job's outcome only when the controller told it (``Shutdown``);
    a controller lost for good is :attr:`ExitCode.RELAUNCH`, never success.
    SIGTERM is ignored: on preemption the controller saves a checkpoint and ends the job.
    """
    from chameleon.runtime.node.processes import forkserver

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    forkserver(start=True, ready=True)  # register only once workers can start at once
    gc.freeze()  # collections walk the agent's own objects, not torch's
    contact_s = Timeouts.of(config).contact_s
    run_dir: str | None = None  # where the job writes, once admitted: a lost controller's relaunch resumes from it
    deadline = time.monotonic() + join_timeout_s
    while True:
        try:
            link = connect(master_addr, control_port, key)
        except SecretMismatch as err:
            print(f"chameleon agent {node}: refused: {err}: set the same {SECRET_ENV} on every node", file=sys.stderr,
                  flush=True)
            return ExitCode.CONFIG
        except AuthError as err:
            print(f"chameleon agent {node}: no Chameleon controller answers at {master_addr}:{control_port} ({err}): "
                  "check launcher.master_addr and launcher.control_port", file=sys.stderr, flush=True)
            return ExitCode.CONFIG
        except OSError as err:
            if run_dir is not None and (isinstance(err, ConnectionRefusedError) or time.monotonic() > deadline):
                return _controller_lost(node, config, run_dir, f"nothing answers at {master_addr}:{control_port}")
            if time.monotonic() > deadline:
                print(f"chameleon agent {node}: no controller at {master_addr}:{control_port} within "
                      f"{join_timeout_s:.0f} s ({err}): start node 0 first, or check launcher.master_addr/master_port",
                      file=sys.stderr, flush=True)
                return ExitCode.FAILED
            time.sleep(0.2)
            continue
        problem = None if run_dir is not None else store_problem(master_addr, config.launcher.master_port)
        if problem:
            link.close()
            print(f"chameleon agent {node}: {problem}", file=sys.stderr, flush=True)
            return ExitCode.CONFIG
        try:
            link.send(Hello(node, _devices(config, node), os.getpid(), node_addr or socket.gethostname(),
                            host_identity(), config, returning=run_dir is not None))
            reply = link.recv(join_timeout_s)
        except (EOFError, OSError):  # the controller's process ended first
            if run_dir is not None:
                return _controller_lost(node, config, run_dir, "it closed the link before admitting this node again")
            print(f"chameleon agent {node}: the controller at {master_addr}:{control_port} closed the link before "
                  "admitting this node", file=sys.stderr, flush=True)
            return ExitCode.FAILED
        if not isinstance(reply, Welcome):
            if isinstance(reply, Shutdown) and reply.outcome is not None:
                return _job_ended(node, reply)
            why = reply.why if isinstance(reply, Shutdown) else "no answer"
            print(f"chameleon agent {node}: not admitted: {why}", file=sys.stderr, flush=True)
            return ExitCode.CONFIG
        run_dir = reply.run_dir
        outcome = _relay(link, reply, node=node, master_addr=master_addr, node_addr=node_addr, contact_s=contact_s)
        if isinstance(outcome, Shutdown):
            return _job_ended(node, outcome)
        print(f"chameleon agent {node}: {outcome}; my workers are stopped, registering again", file=sys.stderr, flush=True)
        deadline = time.monotonic() + join_timeout_s


def _job_ended(node: int, shutdown: Shutdown) -> int:
    """The exit code of an agent the controller told the job ended: node 0's own."""
    code = ExitCode(shutdown.outcome)
    if code != ExitCode.TRAINED:
        print(f"chameleon agent {node}: {shutdown.why} (exit {int(code)}, {code.name.lower()}): node 0's output says "
              "why", file=sys.stderr, flush=True)
    return code


def _controller_lost(node: int, config: Config, run_dir: str, why: str) -> int:
    """A controller gone before it said the job ended: the job's outcome is unknown here, so it is to be relaunched."""
    from chameleon.runtime.checkpoint import checkpoint_root

    root = checkpoint_root(config.ckpt, run_dir)
    how = (f"with ckpt.resume={root} to continue from its newest checkpoint" if config.ckpt.interval
           else "from its start (it saves no checkpoints: ckpt.interval=0)")
    print(f"chameleon agent {node}: lost the controller before it said the job ended ({why}): relaunch the job on "
          f"every node {how}", file=sys.stderr, flush=True)
    return ExitCode.RELAUNCH


def _devices(config: Config, node: int) -> tuple[int, ...]:
    per = config.launcher.nproc_per_node
    return tuple(range(node * per, (node + 1) * per))


def _relay(link: Link, welcome: Welcome, *, node: int, master_addr: str, node_addr: str | None,
           contact_s: float) -> Shutdown | str:
    """Serve one admission: until the controller's Shutdown (returned) or the contact is lost (why); workers are
    stopped either way."""
    from chameleon.runtime.node.processes import Processes

    lost: list[str] = []
    sent = [time.monotonic()]

    def report(message: object) -> None:
        try:
            link.send(message)
            sent[0] = time.monotonic()
        except OSError as err:
            lost.append(f"the link to the controller broke ({err})")

    config: Config = welcome.config
    agent = Agent(node=node, devices=_devices(config, node), report=report)
    pool = Processes(node=node, config=config, run_dir=welcome.run_dir, store_host=master_addr,
                     store_port=welcome.store_port, node_addr=node_addr, report=agent.from_worker,
                     greeting=agent.greeting)
    agent.pool = pool
    agent.generation = pool.generation = welcome.generation
    pool.start(welcome.start.devices, welcome.start.faults)
    lease_s = Timeouts.of(config).renew_s
    heard = time.monotonic()
    outcome: str | Shutdown | None = None
    try:
        while outcome is None:
            if lost:
                outcome = lost[0]
            elif time.monotonic() - heard > contact_s:  # first thing after a stop: never act on a lapsed lease
                outcome = f"my lease lapsed ({time.monotonic() - heard:.1f} s without the controller)"
            else:
                outcome, heard = _serve_once(link, agent, pool, heard)
                pool.tick()
                if outcome is None and time.monotonic() - sent[0] >= lease_s:
                    report(Lease(node, agent.generation))
                if link.pending:
                    link.flush()
    finally:
        if isinstance(outcome, Shutdown):  # workers waiting for a generation see the end and leave
            pool.push(End(outcome.generation), codec.encode(End(outcome.generation)))
        pool.stop(grace_s=outcome.grace_s if isinstance(outcome, Shutdown) else 0.0)  # fencing kills at once
        link.close()
    return outcome


def _serve_once(link: Link, agent: Agent, pool, heard: float) -> tuple[str | Shutdown | None, float]:
    """One wait: relay workers, obey the controller; returns (the Shutdown or why the admission ended, last contact)."""
    ready = [link] if link.buffered else wait([link, *pool.waitables()], timeout=TICK_S)
    for item in ready:
        if item is not link:
            pool.on_ready(item)
            continue
        try:
            messages = link.receive()
        except (EOFError, OSError, AuthError) as err:
            return f"lost the controller ({str(err) or 'closed'})", heard
        for order, frame in messages:
            heard = time.monotonic()
            if isinstance(order, Shutdown):
                return order, heard
            agent.obey(order, frame)
    return None, heard
