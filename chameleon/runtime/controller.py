"""The controller: the job's event loop on node 0. It holds no model state.

It hosts the c10d store, runs node 0's agent in-process and accepts every other
node's agent over an authenticated link. Each turn of its loop it takes what the
agents report — worker messages, exits, hangs, lease renewals with every worker's
position — and feeds the parts it owns:

- the :class:`~chameleon.runtime.ledger.Ledger` (who is ready, which step commits,
  which samples trained, which checkpoint is whole);
- the :class:`~chameleon.runtime.detector.Detector` (lapsed node leases, and the
  progress watchdog for workers alive but stuck);
- the :class:`~chameleon.runtime.coordinator.Coordinator` (a fault or a re-join →
  Eq. 8 → the next generation's plan and manifest);
- the :class:`~chameleon.runtime.faults.Injector` (faults fired from outside).

It carries out what they return: store keys (generation specs, starts, commits
with their orders, fault flags), orders to agents (start, fence, inject), and the
run directory's outputs. ``docs/protocol.md`` gives the protocol as a state table.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from chameleon.config import model_config, world_size
from chameleon.data.stream import sample_ids_digest
from chameleon.decision.config import ClusterConfig, PolicyConfig
from chameleon.decision.measured import Measured, plan_shape
from chameleon.decision.planner import Planner, precompute_single_faults
from chameleon.decision.profiler import load_profile
from chameleon.decision.selector import Decision
from chameleon.layout.plan import Plan
from chameleon.optim import learning_rate, schedule_of
from chameleon.report.outputs import JsonLines, write_json
from chameleon.runtime.agent import LEASE_S, Agent, forkserver
from chameleon.runtime.beacon import Position
from chameleon.runtime.checkpoint import checkpoint_root, commit_checkpoint, latest_checkpoint
from chameleon.runtime.comm import fault_key
from chameleon.runtime.coordinator import Coordinator, SavedState, Transition
from chameleon.runtime.detector import Detector
from chameleon.runtime.errors import JobRestart, Preempted, TrainingError
from chameleon.runtime.faults import FaultSpec, Injector, controller_faults, planned_faults
from chameleon.runtime.launch import LaunchError, host_identity
from chameleon.runtime.ledger import CheckpointComplete, CommitStep, Ledger
from chameleon.runtime.messages import (
    CheckpointSaved, Done, Dying, Exited, Failed, FinalShards, Hello, Hung, Inject, Lease, Left, Ready, Renew,
    Shutdown, Signal, Standby, Start, Synced, Welcome,
)
from chameleon.runtime.preflight import ports_problem
from chameleon.runtime.wire import AuthError, Link, Listener
from chameleon.runtime.worker import (
    ALIVE_KEY, END_KEY, LATEST_KEY, CommitOrder, GenerationSpec, commit_key, node_dying_key, spec_key, start_key,
)

TICK_S = 0.01
ALIVE_EVERY_S = 0.5
REAP_S = 30.0
GROW_SETTLE_S = 0.5  # wait for more returning devices this long after the last one
STEADY_AFTER = 2  # a generation's first steps (restore, warm-up) are left out of its plan's measured step time
FIRED_FILE = "faults_fired.json"
NODE_LOCAL_KEYS = ("launcher.node_rank", "launcher.node_addr", "output", "report")  # may differ between nodes


@dataclass
class Recovery:
    """Timeline of one fault, from the fault to the first step committed after it."""

    failed: list[int]
    cause: str
    step: int
    t_fault: float
    t_detect: float
    t_fault_source: str
    where: dict[int, dict]
    t_decided: float = 0.0
    t_started: float = 0.0
    t_first_commit: float = 0.0
    decision: dict = field(default_factory=dict)
    manifest_bytes: int = 0
    manifest_rounds: int = 0
    estimated_step_s: float = 0.0
    first_step_s: float = 0.0

    def record(self) -> dict:
        return {
            "failed_ranks": self.failed,
            "cause": self.cause,
            "step": self.step,
            "where": self.where,
            "chosen": self.decision.get("choice"),
            "t_fault_source": self.t_fault_source,
            "detect_s": self.t_detect - self.t_fault,
            "decide_s": self.t_decided - self.t_detect,
            "restore_s": self.t_started - self.t_decided,
            "redo_s": self.t_first_commit - self.t_started,
            "total_s": self.t_first_commit - self.t_fault,
            "manifest_bytes": self.manifest_bytes,
            "manifest_rounds": self.manifest_rounds,
            "first_step_s": self.first_step_s,
            "estimated_step_s": self.estimated_step_s,
            "d_s": self.decision.get("d_s"),
        }


@dataclass
class Growth:
    """Timeline of a re-join, from the devices' return to the first step committed on the grown plan."""

    devices: list[int]
    t_back: float
    t_decided: float = 0.0
    t_switch: float = 0.0
    t_started: float = 0.0
    t_first_commit: float = 0.0
    decision: dict = field(default_factory=dict)
    plan: str = ""  # the grown plan, described
    manifest_bytes: int = 0
    estimated_step_s: float = 0.0

    def record(self) -> dict:
        return {
            "devices": self.devices, "chosen": self.decision.get("choice"), "plan": self.plan,
            "decide_s": self.t_decided - self.t_back, "switch_wait_s": self.t_switch - self.t_decided,
            "restore_s": self.t_started - self.t_switch, "first_step_s": self.t_first_commit - self.t_started,
            "total_s": self.t_first_commit - self.t_back, "manifest_bytes": self.manifest_bytes,
            "estimated_step_s": self.estimated_step_s,
        }


@dataclass
class _Node:
    """The controller's end of one node's agent: in-process on node 0, a link elsewhere."""

    node: int
    devices: tuple[int, ...]
    agent: Agent | None = None
    link: Link | None = None
    pid: int = 0
    host: str = ""
    host_id: str = ""  # the physical machine (nodes on loopback addresses of one machine share it)

    def send(self, order: object) -> bool:
        """Deliver an order; False when the node cannot be reached any more."""
        if self.agent is not None:
            self.agent.obey(order)
            return True
        try:
            self.link.send(order)
            return True
        except OSError:
            return False


class Controller:
    """Runs one training job over its nodes: workers, commits, fault detection, recovery, re-joins."""

    def __init__(self, config: dict, *, plan: Plan, run_dir: Path, secret: str):
        self.config, self.run_dir = config, run_dir
        self.launcher, self.train, self.ft = config["launcher"], config["train"], config["ft"]
        self.world = world_size(self.launcher)
        self.per_node = self.launcher["nproc_per_node"]
        self.model = model_config(config)
        self.policy = PolicyConfig(**config["policy"])
        self.measured = load_profile(self.model, ClusterConfig(**config["cluster"]), micro_batch=self.train["micro_batch"],
                                     seq_len=self.train["seq_len"], tp=config["parallel"]["tp"])
        self._cost_model(devices_per_host=self.per_node)
        self.ckpt_root = checkpoint_root(config["ckpt"], run_dir)
        resume = config["ckpt"]["resume"]
        existing = latest_checkpoint(self.ckpt_root)
        if existing is not None and resume is None:
            raise TrainingError(
                f"{self.ckpt_root} already holds checkpoints of another run: pick a new hydra.run.dir or "
                f"ckpt.dir, or continue that run with ckpt.resume={self.ckpt_root}"
            )
        start = latest_checkpoint(Path(resume)) if resume else None
        if resume and start is None:
            raise TrainingError(f"ckpt.resume={resume} holds no complete checkpoint")
        self.resumed_from = start
        self.fired: list[FaultSpec] = _fired(Path(resume)) if resume else []
        faults = planned_faults(config["failure"], world=self.world, nnodes=self.launcher["nnodes"])
        self.faults = [f for f in faults if f not in self.fired]
        self.injector = Injector(controller_faults(self.faults))
        self.first_step = start.committed_steps if start else 0
        self.ledger = Ledger(global_batch=self.train["global_batch"], steps=self.train["steps"], first_step=self.first_step)
        self.detector = Detector(lease_timeout_s=self.ft["heartbeat_timeout_s"])
        self.first_plan = plan
        self.resident = plan
        self.spec: GenerationSpec | None = None
        self.generation = -1
        self.alive: set[int] = set(range(self.world))
        self.standby: dict[int, float] = {}
        self.restarting: set[int] = set()  # devices a returning node is starting, not yet on standby
        self.declined: frozenset[int] = frozenset()
        self.done: set[int] = set()
        self.final: dict[int, dict] = {}
        self.saved = SavedState(start.committed_steps, time.time() - start.age_s, Path(resume)) if start else None
        self.losses: dict[int, float] = {}
        self.step_times: dict[int, float] = {}
        self.ran: dict[tuple, tuple[Plan, list[float]]] = {}  # by plan shape: the plan and its steady step times
        self.resident_times: list[float] = []  # the resident plan's shape's entry of ``ran``
        self.step_ids: dict[int, tuple[int, ...]] = {}
        self.commit_times: dict[int, float] = {}
        self.recoveries: list[Recovery] = []
        self.growths: list[Growth] = []
        self.pending: Recovery | None = None
        self.growing: Growth | None = None
        self.fault_times: list[float] = []
        self.dying: dict[int, Dying] = {}
        self.inbox: list[object] = []
        self.nodes: dict[int, _Node] = {}
        self.arriving: list[Link] = []
        self.preempt = False
        self.stopping = False
        self.t0 = time.time()
        self.t_train: float | None = None
        self.last_commit = self.last_progress = time.monotonic()
        self.last_alive = self.last_observed = 0.0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chameleon-planner")
        self.precomputed: tuple[Plan, Future] | None = None
        self.growth: tuple[Plan, frozenset[int], Future] | None = None
        try:
            self.store = dist.TCPStore(
                self.launcher["master_addr"], self.launcher["master_port"], is_master=True,
                timeout=timedelta(seconds=self.launcher["timeout_s"]), wait_for_workers=False,
            )
            self.listener = None
            if self.launcher["nnodes"] > 1:
                from chameleon.runtime.wire import job_key

                self.listener = Listener(self.launcher["master_addr"], self.launcher["control_port"], job_key(secret))
        except (dist.DistNetworkError, OSError) as err:  # a port taken since train.py checked it
            raise LaunchError(ports_problem(self.launcher) or str(err)) from None

    def _cost_model(self, *, devices_per_host: int) -> None:
        """Profile, planner and coordinator for this launch's topology.

        A measured profile is cached per model and host; how many of this job's devices share a
        host's cores is this launch's: a node's, or the whole job's when every node runs on one host.
        """
        profile = self.measured
        if profile.host_cores:
            profile = replace(profile, n_devices=self.world, devices_per_node=devices_per_host)
        self.profile = profile
        self.planner = Planner(profile, dp_degrees=tuple(self.policy.dp_degrees), pp_lengths=tuple(self.policy.pp_lengths))
        nodes = self.launcher["nnodes"]
        domains = tuple(tuple(range(n * self.per_node, (n + 1) * self.per_node)) for n in range(nodes)) if nodes > 1 else None
        self.coordinator = Coordinator(model=self.model, profile=profile, planner=self.planner, policy=self.policy,
                                       checkpoint_steps=self.config["ckpt"]["interval"], domains=domains)

    # ----- lifecycle -------------------------------------------------------------------

    def run(self) -> Path:
        """Train to the last step through faults; write the outputs; return ``summary.json``'s path."""
        self.metrics = JsonLines(self.run_dir / "metrics.jsonl")
        self.events = JsonLines(self.run_dir / "events.jsonl")
        self.bar = tqdm(total=self.train["steps"], initial=self.first_step, desc="train", unit="step",
                        disable=None if self.config["output"]["progress"] else True, leave=False)  # None: only on a terminal
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            if self.resumed_from is not None:
                self._say(f"chameleon: resuming from {self.resumed_from.path} ({self.first_step} committed steps)")
            self._open_nodes()
            self._loop()
            self._finish(grace_s=REAP_S)
        except BaseException:
            self._finish(grace_s=0.0)  # survivors wait for a generation that will never come
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.pool.shutdown(cancel_futures=True)
            self.bar.close()
            self.metrics.close()
            self.events.close()
        if self.stopping:
            raise Preempted(f"SIGTERM: stopped after saving the checkpoint of step {self.saved.committed_steps}; "
                            f"continue with ckpt.resume={self.ckpt_root}")
        if self.config["output"]["save_params"]:
            self._merge_params()
        return self._write_summary()

    def _open_nodes(self) -> None:
        """Node 0's agent here, every other node's over the network; then generation 0."""
        forkserver(start=True)  # its imports overlap the wait for the other nodes
        local = Agent(node=0, config=self.config, run_dir=str(self.run_dir), store_host=self.launcher["master_addr"],
                      store_port=self.store.port, node_addr=self.launcher["node_addr"], report=self.inbox.append)
        self.nodes[0] = _Node(0, local.devices, agent=local, pid=os.getpid(), host=self.launcher["master_addr"],
                              host_id=host_identity())
        deadline = time.monotonic() + self.launcher["join_timeout_s"]
        while len(self.nodes) < self.launcher["nnodes"]:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.launcher["nnodes"])) - set(self.nodes))
                raise LaunchError(
                    f"nodes {missing} did not join within launcher.join_timeout_s={self.launcher['join_timeout_s']:g} s: "
                    f"run the same command with launcher.node_rank=K on each, reaching "
                    f"{self.launcher['master_addr']}:{self.launcher['control_port']}"
                )
            for item in wait(self._waitables(), timeout=0.1):
                self._on_ready(item)
        if len({node.host_id for node in self.nodes.values()}) == 1 < len(self.nodes):  # loopback nodes share cores
            self._cost_model(devices_per_host=self.world)
        self.events.write({"event": "start", "nodes": {n: {"pid": h.pid, "host": h.host} for n, h in self.nodes.items()},
                           "plan": self.first_plan.describe(), "faults": [f.describe() for f in self.faults]})
        self._publish(self.first_plan, members=tuple(range(self.world)), resume_step=self.first_step,
                      checkpoint=self.config["ckpt"]["resume"])
        for node in self.nodes.values():
            node.send(Start(self.generation, node.devices, self._faults_for(node.devices)))

    def _faults_for(self, devices) -> tuple[FaultSpec, ...]:
        """The worker-fired faults of ``devices`` (their own, their node's) not fired yet."""
        nodes = {d // self.per_node for d in devices}
        return tuple(f for f in self.faults if (f.rank in devices or f.node in nodes) and f not in self.fired)

    def _loop(self) -> None:
        while not self._over():
            for item in wait(self._waitables(), timeout=TICK_S):
                self._on_ready(item)
            local = self.nodes[0].agent
            local.tick()
            self._drain()
            now = time.monotonic()
            if now - self.last_observed >= LEASE_S:  # node 0's positions, as often as a lease brings the others'
                self.last_observed = now
                self.detector.observe(local.positions(), now)
            for node in self.detector.lapsed(now):
                self._on_node_lost(node, f"its agent missed its lease ({self.ft['heartbeat_timeout_s']:g} s)")
            self._fire_timed_faults()
            self._watchdog(now)
            self._consider_growth()
            if now - self.last_alive > ALIVE_EVERY_S:
                self.last_alive = now
                self.store.set(ALIVE_KEY, str(now))

    def _over(self) -> bool:
        finishing = self.ledger.finished or self.stopping
        return finishing and (set(self.ledger.members) & self.alive) <= self.done

    def _waitables(self) -> list:
        items = list(self.nodes[0].agent.waitables()) + self.arriving
        items += [n.link for n in self.nodes.values() if n.link is not None]
        return items + ([self.listener] if self.listener else [])

    def _on_ready(self, item) -> None:
        if item is self.listener:
            for link, why in self.listener.drain():
                if link is None:
                    self._refused(why)
                else:
                    self.arriving.append(link)
        elif item in self.arriving:
            self.arriving.remove(item)
            self._on_hello(item)
        elif isinstance(item, Link):
            self._on_link(item)
        else:
            self.nodes[0].agent.on_ready(item)
        self._drain()

    def _drain(self) -> None:
        while self.inbox:
            self._on_message(self.inbox.pop(0))

    def _finish(self, *, grace_s: float) -> None:
        """End the job everywhere: waiting workers see the end key; every agent stops its workers."""
        try:
            self.store.set(END_KEY, "1")
        except RuntimeError:
            pass
        for node in self.nodes.values():
            if node.link is not None:
                node.send(Shutdown(self.generation, "the job ended" if grace_s else "the job stopped", grace_s))
                node.link.close()
        self.nodes[0].agent.stop(grace_s=grace_s)
        if self.listener is not None:
            self.listener.close()

    # ----- nodes ------------------------------------------------------------------------

    def _on_hello(self, link: Link) -> None:
        """Admit a node that registers (or returns), or refuse it with the reason."""
        try:
            hello = link.recv() if link.poll(5.0) else None
        except (EOFError, OSError, AuthError) as err:
            hello = None
            self._refused(f"{link.peer}: {str(err) or 'closed the link before registering'}")
        if not isinstance(hello, Hello):
            link.close()
            return
        why = self._admission(hello)
        if why:
            self._refused(f"node {hello.node} at {hello.host}: {why}")
            link.send(Shutdown(self.generation, why))
            link.close()
            if self.generation < 0 and "config differs" in why:  # a mistake in how the job was launched
                raise LaunchError(f"node {hello.node} at {hello.host}: {why}")
            return
        node = _Node(hello.node, hello.devices, link=link, pid=hello.pid, host=hello.host, host_id=hello.host_id)
        self.nodes[hello.node] = node
        self.detector.renewed(hello.node, time.monotonic())
        start = Start(self.generation, hello.devices, self._faults_for(hello.devices)) if self.generation >= 0 else \
            Start(self.generation, ())
        self.restarting |= set(start.devices)
        link.send(Welcome(hello.node, self.generation, self.config, self.store.port, str(self.run_dir), start))
        self.events.write({"event": "node_joined" if self.generation < 0 else "node_returned", "node": hello.node,
                           "host": hello.host, "pid": hello.pid, "devices": list(hello.devices), "time": time.time()})

    def _admission(self, hello: Hello) -> str | None:
        if not 1 <= hello.node < self.launcher["nnodes"]:
            return f"node_rank {hello.node} is not in 1..{self.launcher['nnodes'] - 1}"
        if hello.node in self.nodes:
            return f"node {hello.node} is already running (agent pid {self.nodes[hello.node].pid})"
        differ = _config_difference(self.config, hello.config)
        if differ:
            return f"its config differs from node 0's in {', '.join(differ)}: run the same command on every node"
        return None

    def _refused(self, why: str) -> None:
        self._say(f"chameleon: refused a connection: {why}")
        self.events.write({"event": "refused", "why": why, "time": time.time()})

    def _on_link(self, link: Link) -> None:
        node = next(n for n in self.nodes.values() if n.link is link)
        while True:
            try:
                if not link.poll():
                    return
                message = link.recv()
            except (EOFError, OSError, AuthError) as err:
                self._on_node_lost(node.node, "its agent's link closed" + (f" ({err})" if str(err) else ""))
                return
            if isinstance(message, Lease):
                now = time.monotonic()
                self.detector.renewed(node.node, now)
                self.detector.observe(message.positions, now)
                node.send(Renew(self.generation))
            else:
                self.inbox.append(message)

    def _on_node_lost(self, index: int, cause: str) -> None:
        node = self.nodes.pop(index, None)
        self.detector.forget(index)
        if node is None:
            return
        node.link.close()  # its agent, if alive, finds its lease lapsed and fences its own workers
        if self.generation < 0:  # before the job started: it may join again
            self.events.write({"event": "node_left", "node": index, "cause": cause})
            return
        for device in node.devices:
            self.standby.pop(device, None)
        lost = set(node.devices) & self.alive
        where: dict[int, Position | None] = {d: self.detector.position(d) for d in lost}
        dying = self._last_words(index)
        if dying is not None:
            self._record_fired([dying.fault])
            where[dying.device] = dying.where
        t_fault = dying.t if dying else time.time()
        self._on_fault(lost, f"node {index} lost: {cause}", t_fault=t_fault, where=where,
                       source="announced" if dying else "detection")

    def _last_words(self, node: int) -> Dying | None:
        """What the node's firer said before taking its whole node down (its agent could not relay it)."""
        key = node_dying_key(node)
        if not self.store.check([key]):
            return None
        dying = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return dying

    # ----- messages ---------------------------------------------------------------------

    def _on_message(self, msg: object) -> None:
        match msg:
            case Ready():
                if self.ledger.on_ready(msg) is not None:
                    self._start_generation()
                self.last_progress = time.monotonic()
            case Synced():
                if (commit := self.ledger.on_synced(msg)) is not None:
                    self._commit(commit)
            case CheckpointSaved():
                if (complete := self.ledger.on_checkpoint_saved(msg)) is not None:
                    self._commit_checkpoint(complete)
            case Standby():
                self._on_standby(msg)
            case Dying():
                self.dying[msg.device] = msg
                self._record_fired([msg.fault])
            case Failed():
                self._on_failed(msg)
            case Exited():
                self.standby.pop(msg.device, None)
                self.restarting.discard(msg.device)
                cause = f"exit code {msg.exitcode}" + (" (SIGKILL)" if msg.exitcode == -signal.SIGKILL else "")
                self._on_fault({msg.device}, cause, t_fault=msg.t_fault, where={msg.device: msg.where},
                               source=msg.t_fault_source)
            case Hung():
                self._on_fault({msg.device}, f"missed heartbeats for {msg.silent_s:.1f} s (hung; fenced with SIGKILL)",
                               t_fault=msg.t_last, where={msg.device: msg.where}, source="last heartbeat")
            case FinalShards():
                self.final[msg.device] = msg.shards
            case Done():
                self.done.add(msg.device)
            case Left():
                pass  # the generation it left was flagged broken by this controller
            case _:
                raise TrainingError(f"unexpected message {msg!r}")

    def _on_failed(self, msg: Failed) -> None:
        if msg.device_fault:
            self._on_fault({msg.device}, f"device error: {msg.error}", t_fault=time.time(),
                           where={msg.device: msg.where}, source="reported")
            return
        log = self.run_dir / "errors.log"
        with log.open("a", encoding="utf-8") as f:
            f.write(f"worker {msg.device} in {msg.where.describe()}:\n{msg.traceback}\n")
        self.events.write({"event": "error", "device": msg.device, "error": msg.error, "where": msg.where.to_dict()})
        raise TrainingError(f"worker {msg.device} failed in {msg.where.describe()}: {msg.error} (traceback in {log})")

    def _on_standby(self, msg: Standby) -> None:
        """A device came back (a restarted worker or a returning node): a candidate for growing."""
        if msg.device in self.alive or msg.device in self.standby:
            return
        self.standby[msg.device] = time.time()
        self.restarting.discard(msg.device)
        self.events.write({"event": "device_back", "device": msg.device, "time": time.time()})

    # ----- generations and steps --------------------------------------------------------

    def _publish(self, plan: Plan, *, members: tuple[int, ...], resume_step: int, manifest=None, checkpoint=None) -> None:
        self.generation += 1
        self.spec = GenerationSpec(self.generation, plan, members, resume_step, manifest, checkpoint)
        self.ledger.publish(self.generation, members=members, trainers=plan.devices,
                            writers=self.coordinator.writers(plan), resume_step=resume_step)
        self.store.set(spec_key(self.generation), pickle.dumps(self.spec))
        self.store.set(LATEST_KEY, str(self.generation))
        self.last_progress = time.monotonic()

    def _start_generation(self) -> None:
        self.store.set(start_key(self.generation), "1")
        self.resident = self.spec.plan
        self.resident_times = self.ran.setdefault(plan_shape(self.resident), (self.resident, []))[1]
        if self.policy.precompute:  # the next single fault becomes a lookup (the planner runs meanwhile)
            self.precomputed = (self.resident, self.pool.submit(precompute_single_faults, self.resident, self.planner))
        now = time.time()
        self.last_commit = self.last_progress = time.monotonic()
        self.t_train = self.t_train or now
        for timeline in (self.pending, self.growing):
            if timeline is not None:
                timeline.t_started = now

    def _commit(self, c: CommitStep) -> None:
        """Let workers apply the step, with the order for what follows; log it."""
        order, committed_in = CommitOrder(), self.generation
        steady = self.spec.plan is self.resident and c.step >= self.spec.resume_step + STEADY_AFTER
        if self.preempt and not self.stopping and not self.ledger.finished:
            order, self.stopping = CommitOrder(save=True, stop=True), True
            self._say(f"chameleon: SIGTERM: saving a checkpoint after step {c.step}, then stopping")
        elif not self.ledger.finished and (grown := self._ripe_growth()) is not None:
            order = CommitOrder(switch_to=self._switch(grown))
        self.store.set(commit_key(committed_in, c.step), pickle.dumps(order))
        now_m, now = time.monotonic(), time.time()
        dt = now_m - self.last_commit  # the whole step: compute, sync, commit, the previous optimizer step
        self.last_commit = self.last_progress = now_m
        batch = self.train["global_batch"]
        self.losses[c.step], self.step_times[c.step], self.step_ids[c.step] = c.loss, dt, c.sample_ids
        if steady:
            self.resident_times.append(dt)
        self.commit_times[c.step] = now
        self.metrics.write({
            "step": c.step, "loss": c.loss, "samples_per_s": batch / dt, "tokens_per_s": batch * self.train["seq_len"] / dt,
            "step_time_s": dt, "compute_s": c.compute_s, "generation": committed_in, "time": now,
            "lr": learning_rate(c.step, **schedule_of(self.train)), "grad_norm": c.grad_norm,
        })
        self.bar.n = c.step + 1
        self.bar.set_postfix(loss=f"{c.loss:.4f}", gen=self.generation)
        if self.pending is not None:
            self._close_recovery(now, c.compute_s)
        if self.growing is not None and self.growing.t_started:
            self._close_growth(now)

    def _commit_checkpoint(self, complete: CheckpointComplete) -> None:
        commit_checkpoint(self.ckpt_root, complete.step, expected_devices=complete.writers,
                          shapes=self.coordinator.shapes, config=self.config, keep=self.config["ckpt"]["keep"],
                          generation=complete.generation)
        self.saved = SavedState(complete.step, self.commit_times[complete.step - 1], self.ckpt_root)
        self.events.write({"event": "checkpoint", "step": complete.step, "path": str(self.ckpt_root),
                           "generation": complete.generation})

    def _close_recovery(self, now: float, step_s: float) -> None:
        rec, self.pending = self.pending, None
        rec.t_first_commit, rec.first_step_s = now, step_s
        self.recoveries.append(rec)
        self.events.write({"event": "recovered", "generation": self.generation, "time": now, **rec.record()})
        self._say(
            f"chameleon: recovered from the loss of {rec.failed} by {rec.decision.get('choice')} in "
            f"{rec.t_first_commit - rec.t_fault:.3f} s (detect {rec.t_detect - rec.t_fault:.3f}, decide "
            f"{rec.t_decided - rec.t_detect:.3f}, restore {rec.t_started - rec.t_decided:.3f}, redo "
            f"{rec.t_first_commit - rec.t_started:.3f}); step {step_s:.3f} s vs {rec.estimated_step_s:.3f} s estimated"
        )

    # ----- faults -----------------------------------------------------------------------

    def _on_fault(self, devices: set[int], cause: str, *, t_fault: float, where: dict, source: str) -> None:
        """Fence the lost devices, flag the generation broken, decide, and publish the next generation."""
        t_detect = time.time()
        self._fence(devices)  # harmless for the dead; a returned device that fails again is dropped too
        for device in devices:
            self.standby.pop(device, None)
        devices = devices & self.alive
        if not devices:
            return
        self.alive -= devices
        self.store.set(fault_key(self.generation), "1")
        self.ledger.break_generation()
        step = self.ledger.next_step
        self._record_fired([f for f in self.faults if (f.rank in devices or f.node in {d // self.per_node for d in devices})
                            and f.step is not None and f.step <= step])
        positions = {d: (p.to_dict() if isinstance(p, Position) else None) for d, p in where.items()}
        if self.ft["on_fault"] == "exit":
            self.events.write({"event": "fault", "failed_ranks": sorted(devices), "cause": cause, "t_fault": t_fault,
                               "step": step, "where": positions, "action": "exit for a relaunch"})
            raise JobRestart(f"devices {sorted(devices)} lost at step {step} ({cause}); ft.on_fault=exit: "
                             f"relaunch with ckpt.resume={self.ckpt_root}")
        self.fault_times.append(t_fault - self.t0)
        if self.pending is None:
            self.pending = Recovery(sorted(devices), cause, step, t_fault, t_detect, source, positions)
        else:
            self.pending.failed = sorted(set(self.pending.failed) | devices)
            self.pending.cause += f"; then {cause} during recovery"
            self.pending.where.update(positions)
        self.growing = None
        for f in self.injector.during_decision(step):
            self._inject(f)
        transition = self.coordinator.recover(
            self.resident, alive=self.alive, next_step=step, saved=self.saved, now=time.time(),
            fault_times=self.fault_times, elapsed_s=t_detect - self.t0, precomputed=self._precomputed_for(devices),
            fresh=None if self.t_train is not None else self.config["ckpt"]["resume"] or "", measured=self._measured(),
        )
        rec = self.pending
        rec.t_decided, rec.decision = time.time(), transition.decision.to_dict()
        rec.estimated_step_s = transition.estimated_step_s
        if transition.manifest is not None:
            rec.manifest_bytes, rec.manifest_rounds = transition.manifest.wire_bytes, len(transition.manifest.rounds)
        self.events.write({
            "event": "fault", "generation": self.generation, "failed_ranks": sorted(devices), "cause": cause,
            "step": step, "where": positions, "t_fault": t_fault, "t_fault_source": source,
            "detect_s": t_detect - t_fault, "decide_s": rec.t_decided - t_detect, "decision": rec.decision,
            "manifest_bytes": rec.manifest_bytes, "manifest_rounds": rec.manifest_rounds,
        })
        victims = "; ".join(f"device {d}: {p['where']}" for d, p in positions.items() if p)
        reload = ""
        if transition.checkpoint:
            reload = (f"reloading the checkpoint of step {transition.resume_step} "
                      f"({t_detect - self.saved.committed_at:.1f} s of progress lost)\n")
        self._say(f"\nchameleon: devices {sorted(devices)} lost at step {step} ({cause})"
                  + (f"\n  where: {victims}" if victims else "")
                  + f"\n{transition.decision.table()}\n{reload}new plan:\n{transition.plan.describe()}")
        self._publish(transition.plan, members=transition.members, resume_step=transition.resume_step,
                      manifest=transition.manifest, checkpoint=transition.checkpoint)

    def _precomputed_for(self, devices: set[int]) -> Plan | None:
        """The plan precomputed for this single fault, if any (waiting out the planner thread first)."""
        if self.growth is not None:
            future = self.growth[2]
            if not future.cancel():
                _quietly(future)
            self.growth = None
        failed = set(self.resident.devices) - self.alive
        if self.precomputed is None or self.precomputed[0] is not self.resident or len(failed) != 1:
            if self.precomputed is not None:
                _quietly(self.precomputed[1])
            return None
        return self.precomputed[1].result().get(next(iter(failed)))

    def _fence(self, devices: set[int]) -> None:
        """Make sure lost devices are dead: SIGKILL through their agents, where those can be reached."""
        for device in devices:
            node = self.nodes.get(device // self.per_node)
            if node is not None:
                node.send(Signal(self.generation, device, signal.SIGKILL, "fenced"))

    def _inject(self, f: FaultSpec) -> None:
        target = f.node if f.node is not None else f.rank // self.per_node
        node = self.nodes.get(target)
        if node is not None and (f.rank is None or f.rank in self.alive):
            self._record_fired([f])
            self.events.write({"event": "injected", "fault": f.describe(), "generation": self.generation,
                               "step": self.ledger.next_step, "recovering": self.pending is not None, "time": time.time()})
            node.send(Inject(self.generation, f))

    def _fire_timed_faults(self) -> None:
        if self.t_train is not None:
            for f in self.injector.due(time.time() - self.t_train):
                self._inject(f)

    def _record_fired(self, faults: list[FaultSpec]) -> None:
        """Remember fired faults in the checkpoint root, so a relaunch with ckpt.resume never fires them again."""
        new = [f for f in faults if f not in self.fired]
        if new:
            self.fired += new
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
            write_json(self.ckpt_root / FIRED_FILE, {"fired": [f.__dict__ for f in self.fired]})

    def _watchdog(self, now: float) -> None:
        """No commit within the progress bound: fence the devices stuck on their own, or stop naming the silent ones."""
        bound = self._stall_bound()
        quiet = now - self.last_progress
        if self.generation < 0 or quiet <= bound or self.ledger.finished or self.stopping:
            return
        silent = set(self.ledger.unreported()) & self.alive
        stall = self.detector.stall(silent, now=now, bound_s=bound)
        if stall.stuck:
            where = {d: stall.silent[d] for d in stall.stuck}
            self._on_fault(set(stall.stuck), f"no progress for {quiet:.1f} s while alive and heartbeating (stalled; "
                           "fenced with SIGKILL)", t_fault=time.time() - quiet, where=where, source="progress watchdog")
            return
        if stall.suspects:  # still for less than the bound so far: proven stuck, or moving again, soon
            return
        raise TrainingError(
            f"no step committed for {quiet:.0f} s (bound {bound:.0f} s) and no device is stuck on its own; "
            f"devices that have not reported: {stall.describe() or 'none'}"
        )

    def _stall_bound(self) -> float:
        """How long the job may go without progress: ``ft.stall_timeout_s``, else derived from the step time.

        Until a generation starts (workers starting, groups connecting, state moving) the backend's
        own timeout bounds every wait, so the bound is at least ``launcher.timeout_s``.
        """
        bound = self.ft["stall_timeout_s"]
        if bound is None:
            expected = self.coordinator.step_estimate(self.resident)
            if self.step_times:
                recent = sorted(self.step_times.values())[-20:]
                expected = max(expected, recent[len(recent) // 2])
            bound = max(self.ft["stall_min_s"], self.ft["stall_factor"] * expected)
        return bound if self.ledger.started else max(bound, self.launcher["timeout_s"])

    # ----- growing back -----------------------------------------------------------------

    def _consider_growth(self) -> None:
        """Returned devices: decide in the planner's thread whether growing onto them pays."""
        joining = frozenset(self.standby)
        if not joining or joining == self.declined or self.growth is not None or self.stopping:
            return
        settling = time.time() - max(self.standby.values()) < GROW_SETTLE_S
        if settling and self.restarting:  # a node's devices come back together: wait for the rest, a moment
            return
        if not self.ledger.started or self.ledger.finished or self.pending is not None:
            return
        self.growth = (self.resident, joining, self.pool.submit(
            self.coordinator.grow, self.resident, alive=set(self.alive), joining=set(joining),
            fault_times=list(self.fault_times), elapsed_s=time.time() - self.t0, saved=self.saved, now=time.time(),
            measured=self._measured(),
        ))

    def _measured(self) -> Measured:
        """The step times measured so far, and the estimator's scale on the plan running now."""
        return Measured.of(self.ran.values(), self.resident, self.coordinator.step_estimate(self.resident))

    def _ripe_growth(self) -> Transition | None:
        """A decided growth, if it is ready and still stands (same plan, same devices back)."""
        if self.growth is None or not self.growth[2].done():
            return None
        resident, joining, future = self.growth
        self.growth = None
        if resident is not self.resident or not joining <= set(self.standby):
            return None
        outcome: Transition | Decision = future.result()
        t_back = min(self.standby[d] for d in joining)
        if isinstance(outcome, Decision):
            self.declined = joining
            self.events.write({"event": "growth", "devices": sorted(joining), "choice": outcome.choice,
                               "decision": outcome.to_dict()})
            self._say(f"chameleon: devices {sorted(joining)} are back; growing does not pay now\n{outcome.table()}")
            return None
        self.growing = Growth(sorted(joining), t_back, t_decided=time.time(), decision=outcome.decision.to_dict(),
                              plan=outcome.plan.describe(), estimated_step_s=outcome.estimated_step_s,
                              manifest_bytes=outcome.manifest.wire_bytes if outcome.manifest else 0)
        return outcome

    def _switch(self, grown: Transition) -> int:
        """Publish the grown generation; the devices it takes in are members from now on."""
        joined = set(grown.members) - self.alive
        for device in joined:
            self.standby.pop(device, None)
        self.alive |= joined
        self.growing.t_switch = time.time()
        self._say(f"chameleon: devices {sorted(joined)} are back: growing\n{grown.decision.table()}\n"
                  f"new plan:\n{grown.plan.describe()}")
        self._publish(grown.plan, members=grown.members, resume_step=self.ledger.next_step, manifest=grown.manifest)
        return self.generation

    def _close_growth(self, now: float) -> None:
        g, self.growing = self.growing, None
        g.t_first_commit = now
        self.growths.append(g)
        self.events.write({"event": "grown", "generation": self.generation, "time": now, **g.record()})
        self._say(f"chameleon: grew onto devices {g.devices} in {g.t_first_commit - g.t_back:.3f} s after they came back "
                  f"(decide {g.t_decided - g.t_back:.3f}, wait for a step boundary {g.t_switch - g.t_decided:.3f}, "
                  f"restore {g.t_started - g.t_switch:.3f}, first step {g.t_first_commit - g.t_started:.3f})")

    # ----- signals and outputs ----------------------------------------------------------

    def _on_sigterm(self, signum, frame) -> None:
        self.preempt = True

    def _say(self, text: str) -> None:
        tqdm.write(text, file=sys.stderr)

    def _merge_params(self) -> None:
        """Assemble the parameter shards the workers sent into full tensors in ``final_params.pt``."""
        merged: dict[str, torch.Tensor] = {}
        for shards in self.final.values():
            for name, (region, shard) in shards.items():
                full = merged.setdefault(name, torch.empty(self.coordinator.shapes[name]))
                full[tuple(slice(a, b) for a, b in region)] = shard
        if merged:
            torch.save({n: merged[n] for n in self.coordinator.shapes if n in merged}, self.run_dir / "final_params.pt")

    def _write_summary(self) -> Path:
        batch, steps = self.train["global_batch"], sorted(self.losses)
        if steps != list(range(self.first_step, self.train["steps"])):
            raise TrainingError(f"only {len(steps)} of train.steps={self.train['steps']} steps were committed")
        first_fault = self.recoveries[0].step if self.recoveries else steps[-1] + 1
        last_fault = self.recoveries[-1].step if self.recoveries else 0
        before = [self.step_times[s] for s in steps[1:] if s < first_fault]
        after = [self.step_times[s] for s in steps if s > last_fault] if self.recoveries else []
        steady = [self.step_times[s] for s in steps[1:]] or [self.step_times[steps[0]]]
        rate = lambda ts: batch * len(ts) / sum(ts) if ts else None  # noqa: E731
        return write_json(self.run_dir / "summary.json", {
            "first_step": self.first_step,
            "steps_completed": len(steps),
            "final_loss": self.losses[steps[-1]],
            "losses": [self.losses[s] for s in steps],
            "samples_per_s": rate(steady),
            "tokens_per_s": rate(steady) * self.train["seq_len"],
            "mean_step_time_s": sum(steady) / len(steady),
            "samples_per_s_before_fault": rate(before),
            "samples_per_s_after_recovery": rate(after),
            "world_size": self.world,
            "nnodes": self.launcher["nnodes"],
            "plan": self.resident.describe(),
            "generations": self.generation + 1,
            "recoveries": [r.record() for r in self.recoveries],
            "growths": [g.record() for g in self.growths],
            "sample_ids_digest": sample_ids_digest([list(self.step_ids[s]) for s in steps]),
            "wall_s": time.time() - self.t0,
            "startup_s": (self.t_train - self.t0) if self.t_train else None,
        })


def _config_difference(ours: dict, theirs: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ between two configs (what may differ between nodes aside)."""
    out = []
    for key in sorted(set(ours) | set(theirs)):
        path = f"{prefix}{key}"
        if path in NODE_LOCAL_KEYS:
            continue
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_difference(a, b, f"{path}.")
        elif a != b:
            out.append(path)
    return out


def _fired(root: Path) -> list[FaultSpec]:
    """The faults an earlier launch of this job fired (recorded in its checkpoint root)."""
    path = root / FIRED_FILE
    if not path.is_file():
        return []
    return [FaultSpec(**f) for f in json.loads(path.read_text())["fired"]]


def _quietly(future: Future) -> None:
    """Wait for a background planner job, whatever its outcome (a fault supersedes it)."""
    try:
        future.result()
    except Exception:  # noqa: BLE001 - its result is no longer wanted
        pass


def run_training(config: dict, *, plan: Plan, run_dir: Path, secret: str) -> Path:
    """Train as ``config`` says through any injected faults; return ``summary.json``'s path."""
    return Controller(config, plan=plan, run_dir=run_dir, secret=secret).run()
