"""The controller: the job's event loop on node 0, the edge around its protocol core. It holds no model state.

It hosts the c10d store (which serves process-group rendezvous only), runs node
0's agent in-process, and accepts every other node's agent over an authenticated
link. Each turn of its loop it gathers what happened — a registration, an
agent's messages, a closed link, time passing, a SIGTERM — hands each to the
:class:`~chameleon.runtime.control.core.Core` as an event and carries out the effects it
returns: messages to one agent or all (a broadcast is encoded once), links to
close, checkpoints to commit on disk, and the run's outputs through the
:class:`~chameleon.runtime.control.recorder.Recorder`. Links are non-blocking and polled
through one ``epoll`` set, so a slow or stopped agent never holds the loop up.
``docs/protocol.md`` gives the protocol as a state table.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

from chameleon.config import Config, world_size
from chameleon.decision.coordinator import SavedState
from chameleon.decision.profiler import device_overheads, load_profile
from chameleon.faults.spec import FaultSpec, planned_faults
from chameleon.layout.memory import plan_memory
from chameleon.layout.plan import Plan
from chameleon.model.spec import spec_of
from chameleon.report.outputs import write_json
from chameleon.runtime.checkpoint import (
    checkpoint_root,
    commit_checkpoint,
    latest_checkpoint,
    set_aside,
    step_dir,
    whole_checkpoint,
)
from chameleon.runtime.control.core import Clock, Core
from chameleon.runtime.control.events import (
    Admit,
    Broadcast,
    Close,
    Committed,
    Fired,
    Idle,
    Lost,
    Preempt,
    Received,
    Record,
    Refuse,
    Refused,
    Registered,
    SaveCheckpoint,
    SetAside,
    Send,
    Tick,
    Validated,
)
from chameleon.runtime.control.notices import Notice
from chameleon.runtime.control.offload import InChild
from chameleon.runtime.control.recorder import Recorder
from chameleon.runtime.node.agent import Agent
from chameleon.runtime.node.launch import host_identity
from chameleon.runtime.node.wire import AuthError, Link, open_meeting_points
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.errors import ExitCode, Preempted, TrainingError, exit_code_of
from chameleon.runtime.protocol.messages import Hello, Shutdown

TICK_S = 0.05  # time-driven work (leases, the watchdog, node 0's workers' heartbeats); messages wake the loop at once
HELLO_S = 5.0  # an authenticated agent must say hello this soon
REAP_S = 30.0
FIRED_FILE = "faults_fired.json"


class Controller:
    """Runs one training job over its nodes: workers, commits, fault detection, recovery, re-joins.

    Args:
        config: the job's config.
        plan: the failure-free plan.
        run_dir: where every output goes.
        secret: the job's secret (authenticates the agents' links).
        local_pool: builds node 0's worker pool from its agent (default: real worker processes).

    The planner's background work and the recovery decisions run in a child process (:class:`InChild`) forked from
    the workers' forkserver, started first: the server's imports overlap the rest of start-up, and the first
    precompute simply waits for them.
    """

    def __init__(self, config: Config, *, plan: Plan, run_dir: Path, secret: str, local_pool=None):
        from chameleon.runtime.node.processes import forkserver

        self.planning = InChild(forkserver())
        try:
            self._start(config, plan=plan, run_dir=run_dir, secret=secret, local_pool=local_pool)
        except BaseException:
            self.planning.close(grace_s=0.0)  # maybe still importing: nothing it does is wanted
            raise

    def _start(self, config: Config, *, plan: Plan, run_dir: Path, secret: str, local_pool) -> None:
        self.config, self.run_dir = config, run_dir
        launcher = config.launcher
        self.ckpt_root = checkpoint_root(config.ckpt, run_dir)
        resume = config.ckpt.resume
        existing = latest_checkpoint(self.ckpt_root)
        if existing is not None and resume is None:
            raise TrainingError(
                f"{self.ckpt_root} already holds checkpoints of another run: pick a new hydra.run.dir or "
                f"ckpt.dir, or continue that run with ckpt.resume={self.ckpt_root}"
            )
        start, damaged = whole_checkpoint(Path(resume), spec_of(config.model).param_shapes(config.model)) \
            if resume else (None, [])
        self.damaged = [why for _, why in damaged]
        if resume and start is None:
            raise TrainingError(f"ckpt.resume={resume} holds no whole checkpoint: {'; '.join(self.damaged)}")
        for directory, _ in damaged:  # never taken again, and its step may be saved anew
            set_aside(directory)
        self.resumed_from = start
        fired = _fired(Path(resume)) if resume else []
        faults = [f for f in planned_faults(config.failure, world=world_size(launcher), nnodes=launcher.nnodes)
                  if f not in fired]
        profile = load_profile(config.model, config.cluster, micro_batch=config.train.micro_batch,
                               seq_len=config.train.seq_len, tp=config.parallel.tp,
                               recompute=config.train.recompute)
        self.store, self.listener = open_meeting_points(launcher, secret)
        saved = SavedState(start.committed_steps, time.time() - start.age_s, Path(resume)) if start else None
        self.core = Core(config, plan=plan, profile=profile, run_dir=str(run_dir), store_port=self.store.port,
                         ckpt_root=self.ckpt_root, saved=saved, faults=faults, fired=fired,
                         planning=self.planning, clock=Clock())
        self.local_pool = local_pool
        self.links: dict[int, Link] = {}
        self.node_of: dict[Link, int] = {}
        self.arriving: dict[Link, float] = {}
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.planning.woken, selectors.EVENT_READ, data=self.planning)
        self.heard_at = time.monotonic()  # when every link was last read (leases are judged up to then)
        self.watched: dict[int, object] = {}  # node 0's worker pipes and sentinels, by descriptor
        self.inbox: list[object] = []
        self.recorder: Recorder | None = None
        self.agent: Agent | None = None

    # ----- lifecycle ------------------------------------------------------------------------------

    def run(self) -> Path:
        """Train to the last step through faults; write the outputs; return ``summary.json``'s path."""
        self.recorder = Recorder(self.config, self.run_dir, first_step=self.core.first_step)
        gc.freeze()  # what start-up built stays: collections then only walk the loop's own objects, never torch's
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: self._handle(Preempt()))
        try:
            if self.resumed_from is not None:
                passed_over = f", the newest whole checkpoint: {'; '.join(self.damaged)}" if self.damaged else ""
                self.recorder.say(f"chameleon: resuming from {self.resumed_from.path} "
                                  f"({self.core.first_step} committed steps){passed_over}")
            self._open_local_node()
            self._loop()
            self._finish(grace_s=REAP_S, outcome=ExitCode.PREEMPTED if self.core.stopping else ExitCode.TRAINED)
        except BaseException as err:
            self._finish(grace_s=0.0, outcome=exit_code_of(err))  # survivors wait for a generation never coming
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.core.close()
            self.planning.close()
            self.recorder.close()
        if self.core.stopping:
            raise Preempted(f"SIGTERM: stopped after saving the checkpoint of step {self.core.saved.committed_steps}; "
                            f"continue with ckpt.resume={self.ckpt_root}")
        if self.config.output.save_params:
            self._merge_params()
        core, t_end = self.core, time.time()
        parts = self.recorder.time_breakdown(t0=core.t0, t_train=core.t_train, t_end=t_end, spans=core.spans)
        return self.recorder.summary(
            recoveries=[r.record() for r in core.recovery.done], growths=[g.record() for g in core.growth.done],
            reshapes=[r.record() for r in core.reshape.done],
            plan=core.resident.describe(), generations=core.generation + 1, world_size=core.world,
            nnodes=self.config.launcher.nnodes, wall_s=t_end - core.t0, time_breakdown=parts,
            startup_s=(core.t_train - core.t0) if core.t_train else None, store_ops=core.store_ops,
            peak_rss=core.peak_rss, allocator_peaks=core.allocator_peaks,
            memory_estimate=self._memory_estimate(core.resident),
        )

    def _memory_estimate(self, plan: Plan) -> dict[int, float]:
        """The memory model's bytes for every device of ``plan`` (Eq. 14), recorded beside each worker's peak."""
        model, train = self.config.model, self.config.train
        costs = spec_of(model).memory_costs(model, micro_batch=plan.micro_batch_size, seq_len=train.seq_len,
                                            dtype=train.dtype, recompute=train.recompute,
                                            overheads=device_overheads(self.config.cluster))
        return plan_memory(costs, plan)

    def _open_local_node(self) -> None:
        """Node 0's agent, in this process; its registration (the others register over the network)."""
        from chameleon.runtime.node.processes import Processes

        config, launcher = self.config, self.config.launcher
        devices = tuple(range(launcher.nproc_per_node))
        self.agent = Agent(node=0, devices=devices, report=lambda m: self.inbox.append(Received(0, m)))
        if self.local_pool is None:  # the forkserver the workers start from is starting: the planning process asked for it
            self.agent.pool = Processes(node=0, config=config, run_dir=str(self.run_dir), store_host=launcher.master_addr,
                                        store_port=self.store.port, node_addr=launcher.node_addr,
                                        report=self.agent.from_worker, greeting=self.agent.greeting)
        else:
            self.agent.pool = self.local_pool(self.agent)
        self.agent.pool.generation = -1
        if self.listener is not None:
            self.selector.register(self.listener, selectors.EVENT_READ)
        self._handle(Registered(Hello(0, devices, os.getpid(), launcher.master_addr, host_identity(), config)))

    def _loop(self) -> None:
        tick = time.monotonic()
        while not self.core.over:
            self._select(TICK_S)
            if time.monotonic() - tick >= TICK_S:
                tick = time.monotonic()
                self._select(0.0)  # what arrived while the loop was busy (a long publication) renews leases first
                heard_at = self.heard_at  # whatever runs from here on (a publication, a stall) is not a node's silence
                self.agent.pool.tick()
                self.planning.check()  # a planning process that died is the run's end, said in one line
                self._drain()
                self._handle(Tick(heard_at))
                self._expire_arrivals()

    def _select(self, timeout_s: float) -> None:
        self._watch_local()
        ready = self.selector.select(timeout=timeout_s)
        self.heard_at = time.monotonic()  # every link is read below: nothing sent before now goes unseen
        for key, events in ready:
            self._on_ready(key.fileobj if key.data is None else key.data, events)
        self._drain()
        self._handle(Idle())  # what was read is handled: the losses among it are decided as one

    def _finish(self, *, grace_s: float, outcome: ExitCode) -> None:
        """End the job everywhere: every agent stops its workers (waiting ones see the end and leave) and exits
        with ``outcome``, the code node 0 exits with."""
        why = "the job ended" if grace_s else "the job stopped"
        for link in list(self.links.values()) + list(self.arriving):
            link.close_with(Shutdown(self.core.generation, why, grace_s, outcome=outcome))
        if self.agent is not None and self.agent.pool is not None:
            from chameleon.runtime.protocol.messages import End

            end = End(self.core.generation)
            self.agent.pool.push(end, codec.encode(end))
            self.agent.pool.stop(grace_s=grace_s)
        if self.listener is not None:
            self.listener.close()

    # ----- what happened ------------------------------------------------------------------------

    def _watch_local(self) -> None:
        """Keep node 0's worker pipes and sentinels in the selector (workers come and go; by descriptor, as a
        worker's pipe may be closed before it is unwatched)."""
        wanted = {item if isinstance(item, int) else item.fileno(): item for item in self.agent.pool.waitables()}
        for fd in [fd for fd, item in self.watched.items() if wanted.get(fd) is not item]:
            self.selector.unregister(self.watched.pop(fd) and fd)
        for fd, item in wanted.items():
            if fd not in self.watched:
                self.selector.register(fd, selectors.EVENT_READ, data=item)
                self.watched[fd] = item

    def _on_ready(self, item, events: int) -> None:
        if item is self.listener:
            for link, why in self.listener.drain():
                if link is None:
                    self._handle(Refused(why))
                else:
                    self.arriving[link] = time.monotonic()
                    self.selector.register(link, selectors.EVENT_READ)
        elif item in self.arriving:
            self._on_arriving(item)
        elif isinstance(item, Link):
            if item not in self.node_of:
                return  # closed by an event read earlier in this same select (its node lost meanwhile)
            if events & selectors.EVENT_WRITE:
                self._flush(item)
            if events & selectors.EVENT_READ:
                self._on_link(item)
        elif item is self.planning:  # a recovery decided: published now, not at the next tick
            self.planning.drain()
            self.planning.check()
            self._handle(Tick(self.heard_at))
        else:
            self.agent.pool.on_ready(item)
        self._drain()

    def _on_arriving(self, link: Link) -> None:
        """An authenticated agent's first words: its hello (anything else, or nothing, drops it)."""
        try:
            messages = link.receive()
        except (EOFError, OSError, AuthError) as err:
            self._drop_arrival(link)
            self._handle(Refused(f"{link.peer}: {str(err) or 'closed the link before registering'}"))
            return
        if not messages:
            return
        hello = messages[0][0]
        if not isinstance(hello, Hello) or len(messages) > 1:
            self._drop_arrival(link)
            self._handle(Refused(f"{link.peer}: said {type(hello).__name__} before hello"))
            return
        self._handle(Registered(hello), arriving=link)

    def _expire_arrivals(self) -> None:
        now = time.monotonic()
        for link in [ln for ln, t in self.arriving.items() if now - t > HELLO_S]:
            self._drop_arrival(link)
            self._handle(Refused(f"{link.peer}: said nothing within {HELLO_S:.0f} s of connecting"))

    def _drop_arrival(self, link: Link) -> None:
        self.arriving.pop(link, None)
        self.selector.unregister(link)
        link.close()

    def _on_link(self, link: Link) -> None:
        node = self.node_of[link]
        try:
            messages = link.receive()
        except (EOFError, OSError, AuthError) as err:
            self._handle(Lost(node, "its agent's link closed" + (f" ({err})" if str(err) else "")))
            return
        for message, _ in messages:
            if self.links.get(node) is not link:
                return  # lost while we read
            self._handle(Received(node, message))

    def _drain(self) -> None:
        while self.inbox:
            self._handle(self.inbox.pop(0))

    # ----- what to do -----------------------------------------------------------------------------

    def _handle(self, event: object, *, arriving: Link | None = None) -> None:
        try:
            effects = self.core.handle(event)
        except BaseException:
            for effect in self.core.out:  # what it said before it gave up (an error's traceback, a fault's record)
                self._carry_out(effect, arriving)
            raise
        for effect in effects:
            self._carry_out(effect, arriving)

    def _carry_out(self, effect: object, arriving: Link | None) -> None:
        match effect:
            case Send(node=node, message=message, payload=payload):
                self._send(node, message, payload or codec.encode(message))
            case Broadcast(message=message):
                payload = codec.encode(message)
                for node in [0, *self.links]:
                    self._send(node, message, payload)
            case Admit(node=node, welcome=welcome):
                if welcome is not None:
                    self.arriving.pop(arriving)
                    self.links[node], self.node_of[arriving] = arriving, node
                    self._send(node, welcome, codec.encode(welcome))
            case Refuse(why=why):
                self.arriving.pop(arriving, None)
                self.selector.unregister(arriving)
                arriving.close_with(Shutdown(self.core.generation, why))
            case Close(node=node):
                link = self.links.pop(node, None)
                if link is not None:
                    del self.node_of[link]
                    self.selector.unregister(link)
                    link.close()
            case Record() | Committed() | Validated() | Notice():
                self.recorder.write(effect)
            case SaveCheckpoint(complete=c):
                commit_checkpoint(self.ckpt_root, c.step, expected_devices=c.writers, shapes=self.core.coordinator.shapes,
                                  config=asdict(self.config), keep=self.config.ckpt.keep, generation=c.generation)
            case SetAside(root=root, step=step):
                set_aside(step_dir(root, step))
            case Fired(faults=faults):
                self.ckpt_root.mkdir(parents=True, exist_ok=True)
                write_json(self.ckpt_root / FIRED_FILE, {"fired": [asdict(f) for f in faults]})
            case _:
                raise TypeError(f"unexpected effect {effect!r}")

    def _send(self, node: int, message: object, payload: bytes) -> None:
        if node == 0:
            self.agent.obey(message, payload)
            return
        link = self.links.get(node)
        if link is None:
            return
        try:
            link.send_payload(payload)
        except OSError as err:
            self.inbox.append(Lost(node, f"its agent's link broke ({err})"))
            return
        self._flush(link)

    def _flush(self, link: Link) -> None:
        """Send what the socket takes; watch it for writability only while bytes wait."""
        try:
            link.flush()
        except OSError:
            return  # the read side reports the loss
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if link.pending else 0)
        if self.selector.get_key(link).events != want:
            self.selector.modify(link, want)

    def _merge_params(self) -> None:
        """Assemble the parameter shards the workers sent into full tensors in ``final_params.pt``."""
        merged: dict[str, torch.Tensor] = {}
        shapes = self.core.coordinator.shapes
        for shards in self.core.final.values():
            for name, (region, shard) in shards.items():
                full = merged.setdefault(name, torch.empty(shapes[name]))
                full[tuple(slice(a, b) for a, b in region)] = shard
        if merged:
            torch.save({n: merged[n] for n in shapes if n in merged}, self.run_dir / "final_params.pt")


def _fired(root: Path) -> list[FaultSpec]:
    """The faults an earlier launch of this job fired (recorded in its checkpoint root)."""
    path = root / FIRED_FILE
    if not path.is_file():
        return []
    return [FaultSpec(**f) for f in json.loads(path.read_text())["fired"]]


def run_training(config: Config, *, plan: Plan, run_dir: Path, secret: str) -> Path:
    """Train as ``config`` says through any injected faults; return ``summary.json``'s path."""
    return Controller(config, plan=plan, run_dir=run_dir, secret=secret).run()
