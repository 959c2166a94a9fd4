"""The controller's protocol core: events in, effects out, no sockets, no store, no files.

It owns the job's state — the :class:`~chameleon.runtime.control.ledger.Ledger` (who is
ready, which step commits, which samples trained, which checkpoint is whole), the
:class:`~chameleon.runtime.control.detector.Detector` (node leases), the
:class:`~chameleon.decision.coordinator.Coordinator` (a fault or a re-join → Eq. 8 →
the next generation's plan and manifest) and the fault injector — and turns each
event of :mod:`~chameleon.runtime.control.events` into effects (:meth:`Core.handle`).
Machines of their own beside it keep the rest: the progress watchdog
(:mod:`~chameleon.runtime.control.watchdog`), growing back (:mod:`~chameleon.runtime.control.growth`) and
slow devices (:mod:`~chameleon.runtime.control.reshape`). What the user is told leaves as
:mod:`~chameleon.runtime.control.notices`, facts the recorder alone puts into words.

Time comes from an injected clock, and background planning and recovery decisions run as
named requests wherever the edge says (:mod:`~chameleon.runtime.control.planning`: injected
executors, or the controller's planning process; never the event loop's own time), so the
whole protocol runs in tests without a process (``tests/test_core.py``). ``docs/protocol.md``
gives it as a state table.
"""

from __future__ import annotations

import itertools
import signal
import time
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from chameleon.config import Config, OnCorrupt, tags_honoured
from chameleon.decision.config import PolicyConfig
from chameleon.decision.coordinator import SavedState, Transition
from chameleon.decision.measured import Measured, plan_shape
from chameleon.decision.profiler import Profile
from chameleon.faults.spec import FaultSpec, Injector, controller_faults
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import Manifest
from chameleon.schedule import learning_rate, schedule_of
from chameleon.report.breakdown import Span
from chameleon.runtime.control.background import Background
from chameleon.runtime.control.detector import Detector
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
    Send,
    SetAside,
    Tick,
    Validated,
)
from chameleon.runtime.control.growth import Grower
from chameleon.runtime.control.ledger import CheckpointComplete, CommitStep, Evaluation, Ledger
from chameleon.runtime.control.membership import Lifecycle, Membership
from chameleon.runtime.control.notices import (
    CheckpointDamaged,
    ConnectionRefused,
    Disagreed,
    NotFinite,
    NotFiniteAgain,
    Preempting,
    ReplayedFinite,
)
from chameleon.runtime.control.planning import CostModel, InThreads, Parcelling, Planning, Precompute, reframed
from chameleon.runtime.control.recovery import Loss, Recoverer
from chameleon.runtime.control.reshape import Reshaper
from chameleon.runtime.control.watchdog import Stuck, Watchdog
from chameleon.runtime.protocol.errors import JobRestart, LaunchError, TrainingError
from chameleon.runtime.protocol.messages import (
    Begin,
    Commit,
    CommitOrder,
    Damaged,
    Done,
    Dying,
    Exited,
    Failed,
    FinalShards,
    Flag,
    GenerationSpec,
    Hello,
    Hung,
    Inject,
    Lease,
    NodeEvaluated,
    NodeReady,
    NodeSaved,
    NodeSynced,
    Noted,
    Parcels,
    Positions,
    Publish,
    Renew,
    SelfTimed,
    Signal,
    Standby,
    Start,
    Welcome,
    parcel,
)
from chameleon.runtime.protocol.position import Position
from chameleon.runtime.protocol.timeouts import Timeouts
from chameleon.runtime.protocol.topology import Topology

STEADY_AFTER = 2  # a generation's first steps (restore, warm-up) are left out of its plan's measured step time
LEASE_CHECK_S = 0.05  # leases are checked this often (a lapse is seen at most this late)
NODE_LOCAL_KEYS = ("launcher.node_rank", "launcher.node_addr", "output", "report")  # may differ between nodes


class Clock:
    """Wall-clock and monotonic time (a test gives a clock of its own)."""

    wall = staticmethod(time.time)
    mono = staticmethod(time.monotonic)


@dataclass(frozen=True)
class Refusal:
    """Why a registering node is turned away; ``misconfigured``: its launch differs from node 0's (before the
    job starts, that ends the launch: the same command was not run everywhere)."""

    why: str
    misconfigured: bool = False


@dataclass
class NodeInfo:
    """A registered node: its devices and where its agent runs."""

    node: int
    devices: tuple[int, ...]
    pid: int
    host: str
    host_id: str


class Core:
    """The controller's protocol (see the module doc).

    Args:
        config: the job's config.
        plan: the failure-free plan.
        profile: the cost profile measured (or modelled) for this job.
        run_dir: node 0's run directory (told to every node).
        store_port: the c10d store's port (told to every node, for process-group rendezvous).
        ckpt_root: where this job's checkpoints go.
        saved: the checkpoint the job resumes from, if any.
        faults: the faults still to fire; ``fired``: those an earlier launch fired.
        planner: runs the planner's background work: precomputes, growths, reshapes (a thread; inline in tests).
        decider: runs recovery decisions, never on the event loop nor behind the planner's work (a thread of
            their own; inline in tests).
        planning: where the planner's work and the decisions run instead, given (the controller's child process,
            :mod:`~chameleon.runtime.control.offload`); by default, on ``planner`` and ``decider`` in this process.
        clock: time.
    """

    def __init__(self, config: Config, *, plan: Plan, profile: Profile, run_dir: str, store_port: int, ckpt_root: Path,
                 saved: SavedState | None, faults: list[FaultSpec], fired: list[FaultSpec],
                 planner: Executor | None = None, decider: Executor | None = None, planning: Planning | None = None,
                 clock: Clock = Clock()):
        self.config, self.run_dir, self.store_port, self.clock = config, run_dir, store_port, clock
        self.planning: Planning = planning if planning is not None else InThreads(planner, decider)
        self.tokens = itertools.count()  # names each precompute (a request places from the one it names)
        self.ckpt_root = ckpt_root
        self.launcher, self.train, self.ft = config.launcher, config.train, config.ft
        self.topology = Topology.of(self.launcher)
        self.world, self.per_node = self.topology.world, self.topology.per_node
        self.policy: PolicyConfig = config.policy
        self.measured_profile = profile
        self._cost_model(devices_per_host=self.per_node)
        self.fired = list(fired)
        self.faults = faults
        self.injector = Injector(controller_faults(self.faults))
        self.saved = saved
        self.checkpoints = [saved] if saved else []  # those this run may restore from, oldest first
        self.first_step = saved.committed_steps if saved else 0
        self.ledger = Ledger(global_batch=self.train.global_batch, steps=self.train.steps, topology=self.topology,
                             first_step=self.first_step)
        timeouts = Timeouts.of(config)
        self.detector = Detector(lease_timeout_s=timeouts.lease_s, start_timeout_s=timeouts.start_s)
        self.first_plan = self.resident = plan
        self.spec: GenerationSpec | None = None
        self.latest_publish: Publish | None = None
        self.generation = -1
        self.membership = Membership(range(self.world))
        self.done: set[int] = set()
        self.store_ops: dict[int, int] = {}  # per device that finished: its operations on the store
        self.peak_rss: dict[int, int] = {}  # per device that finished: its peak resident memory, bytes
        self.allocator_peaks: dict[int, tuple[int, int]] = {}  # per accelerator that finished: allocated, reserved
        self.final: dict[int, dict] = {}
        self.ran: dict[tuple, tuple[Plan, list[float]]] = {}  # by plan shape: the plan and its steady step times
        self.resident_times: list[float] = []
        self.commit_times: dict[int, float] = {}
        self.val_losses: dict[int, float] = {}  # by step: the validation loss before it
        self.fault_times: list[float] = []
        self.dying: dict[int, Dying] = {}
        self.replaying: CommitStep | None = None  # the step that was not finite, while its replay runs
        self.nodes: dict[int, NodeInfo] = {}
        self.preempt = self.stopping = False
        self.t0 = clock.wall()
        self.t_train: float | None = None
        self.join_deadline = clock.mono() + self.launcher.join_timeout_s
        self.last_commit = self.leases_checked = clock.mono()
        self.watchdog = Watchdog(self.ft, floor_s=self.launcher.timeout_s, compile=self.train.compile, now=clock.mono())
        self.precomputed = Background(self.planning)
        self.recovery = Recoverer(self.planning, self._emit)
        self.growth = Grower(self.planning, self._emit)
        self.reshape = Reshaper(self.ft, self.planning, self._emit)
        self.spans: list[Span] = []  # the run's time that was not training (report.breakdown)
        self.last_commit_wall: float | None = None
        self.out: list[object] = []

    def _cost_model(self, *, devices_per_host: int) -> None:
        """Profile, planner and coordinator for this launch's topology (where the planning runs builds its own
        alike, or uses these).

        A measured profile is cached per model and host; how many of this job's devices share a
        host's cores is this launch's: a node's, or the whole job's when every node runs on one host.
        """
        profile = self.measured_profile
        if profile.host_cores:
            profile = replace(profile, n_devices=self.world, devices_per_node=devices_per_host)
        self.profile = profile
        lengths = tuple(self.policy.pp_lengths)
        nodes = self.launcher.nnodes
        domains = tuple(self.topology.devices_of(n) for n in range(nodes)) if nodes > 1 else None
        cost = CostModel(profile, self.config.model, self.policy, self.config.ckpt.interval, domains,
                         tuple(self.policy.dp_degrees), lengths, tagless=not tags_honoured(self.launcher))
        self.cost = cost
        self.planner_, self.coordinator = cost.build()
        self.planning.model(cost, self.planner_, self.coordinator)

    # ----- the loop's entry ---------------------------------------------------------------------

    def handle(self, event: object) -> list[object]:
        """Apply ``event``; return the effects to carry out, in order.

        Raises:
            TrainingError: the run cannot go on (the message says why); JobRestart under ``ft.on_fault=exit``.
                The effects emitted before it are in :attr:`out` (records of what happened: carry them out).
        """
        self.out = []
        match event:
            case Registered(hello=hello):
                self._on_hello(hello)
            case Received(node=node, message=message):
                self._on_node_message(node, message)
            case Lost(node=node, cause=cause):
                self._on_node_lost(node, cause)
            case Refused(why=why):
                self._refused(why)
            case Tick(heard_at=heard_at):
                self._tick(heard_at)
                self._decide_waiting()
            case Idle():
                self._decide_waiting()
            case Preempt():
                self.preempt = True
            case _:
                raise TypeError(f"unexpected event {event!r}")
        self._decided()
        return self.out

    @property
    def over(self) -> bool:
        """Every member still alive reported done, after the last step or a stop (and no recovery is being decided)."""
        finishing = (self.ledger.finished or self.stopping) and not self.recovery.busy
        return finishing and (set(self.ledger.members) & self.membership.members) <= self.done

    def _emit(self, *effects: object) -> None:
        self.out.extend(effects)

    def _record(self, **event) -> None:
        self._emit(Record(event))

    def _tick(self, heard_at: float | None) -> None:
        now = self.clock.mono()
        if self.generation < 0 and len(self.nodes) < self.launcher.nnodes and now > self.join_deadline:
            missing = sorted(set(range(self.launcher.nnodes)) - set(self.nodes))
            raise LaunchError(
                f"nodes {missing} did not join within launcher.join_timeout_s={self.launcher.join_timeout_s:g} s: "
                f"run the same command with launcher.node_rank=K on each, reaching "
                f"{self.launcher.master_addr}:{self.launcher.control_port}"
            )
        if now - self.leases_checked >= LEASE_CHECK_S:
            self.leases_checked = now
            for node, silent_s in self.detector.lapsed(now if heard_at is None else heard_at).items():
                self._on_node_lost(node, f"its agent missed its lease ({self.detector.lease_timeout_s:g} s; "
                                         f"nothing heard for {silent_s:.1f} s)")
        if self.t_train is not None:
            for f in self.injector.due(self.clock.wall() - self.t_train):
                self._inject(f)
        self._watchdog(now)
        self._consider_growth()
        self._consider_reshape()

    # ----- nodes ----------------------------------------------------------------------------------

    def _on_hello(self, hello: Hello) -> None:
        """Admit a node that registers (or returns), or refuse it with the reason."""
        refusal = self._admission(hello)
        if refusal is not None:
            self._refused(f"node {hello.node} at {hello.host}: {refusal.why}")
            self._emit(Refuse(refusal.why))
            if self.generation < 0 and refusal.misconfigured:  # a mistake in how the job was launched
                raise LaunchError(f"node {hello.node} at {hello.host}: {refusal.why}")
            return
        self.nodes[hello.node] = NodeInfo(hello.node, hello.devices, hello.pid, hello.host, hello.host_id)
        started = self.generation >= 0
        if hello.node and started:
            self.detector.watch(hello.node, self.clock.mono())
        start = Start(self.generation, hello.devices, self._faults_for(hello.devices)) if started else \
            Start(self.generation, ())
        self.membership.restart(start.devices)
        self._emit(Admit(hello.node, Welcome(hello.node, self.generation, self.config, self.store_port, self.run_dir,
                                             start) if hello.node else None))
        if hello.node:  # node 0's agent is this process's own
            self._record(event="node_joined" if not started else "node_returned", node=hello.node, host=hello.host,
                         pid=hello.pid, devices=list(hello.devices), time=self.clock.wall())
        if started:
            # the returning node's standby workers learn the newest generation; not one decided before their loss,
            # which still lists them (the recovery's reaches them as every node)
            if self.latest_publish is not None and not self.latest_publish.spec.device_set & set(hello.devices):
                self._emit(Send(hello.node, self.latest_publish))
        elif len(self.nodes) == self.launcher.nnodes:
            self._open()

    def _admission(self, hello: Hello) -> Refusal | None:
        if hello.node == 0:
            return None  # node 0's agent runs in the controller's own process
        if not 1 <= hello.node < self.launcher.nnodes:
            return Refusal(f"node_rank {hello.node} is not in 1..{self.launcher.nnodes - 1}")
        if hello.node in self.nodes:
            return Refusal(f"node {hello.node} is already running (agent pid {self.nodes[hello.node].pid})")
        differ = config_difference(asdict(self.config), asdict(hello.config))
        if differ:
            return Refusal(f"its config differs from node 0's in {', '.join(differ)}: run the same command on every "
                           "node", misconfigured=True)
        return None

    def _open(self) -> None:
        """Every node registered: generation 0, and each node's workers started."""
        if len({n.host_id for n in self.nodes.values()}) == 1 < len(self.nodes):  # loopback nodes share cores
            self._cost_model(devices_per_host=self.world)
        self._record(event="start", nodes={n: {"pid": h.pid, "host": h.host} for n, h in self.nodes.items()},
                     plan=self.first_plan.describe(), faults=[f.describe() for f in self.faults])
        self._publish(self.first_plan, members=tuple(range(self.world)), resume_step=self.first_step,
                      checkpoint=self.config.ckpt.resume)
        for node in self.nodes.values():
            self._emit(Send(node.node, Start(self.generation, node.devices, self._faults_for(node.devices))))
            if node.node:
                self.detector.watch(node.node, self.clock.mono())

    def _faults_for(self, devices) -> tuple[FaultSpec, ...]:
        """The worker-fired faults of ``devices`` (their own, their node's) not fired yet."""
        nodes = {self.topology.node_of(d) for d in devices}
        return tuple(f for f in self.faults if (f.rank in devices or f.node in nodes) and f not in self.fired)

    def _refused(self, why: str) -> None:
        self._emit(ConnectionRefused(why))
        self._record(event="refused", why=why, time=self.clock.wall())

    def _on_node_lost(self, index: int, cause: str) -> None:
        node = self.nodes.pop(index, None)
        self.detector.forget(index)
        if node is None:
            return
        self._emit(Close(index))
        if self.generation < 0:  # before the job started: it may join again
            self._record(event="node_left", node=index, cause=cause)
            return
        where: dict[int, Position | None] = {d: None for d in node.devices if self.membership.is_member(d)}
        dying = next((self.dying.pop(d) for d in node.devices if d in self.dying), None)
        if dying is not None:
            where[dying.device] = dying.where
        self._on_fault(set(node.devices), f"node {index} lost: {cause}",
                       t_fault=dying.t if dying else self.clock.wall(), where=where,
                       source="announced" if dying else "detection")

    # ----- messages -------------------------------------------------------------------------------

    def _on_node_message(self, node: int, msg: object) -> None:
        if node not in self.nodes:
            return  # a node already declared lost: nothing it says counts
        self.detector.renewed(node, self.clock.mono())
        match msg:
            case Lease():
                self._emit(Send(node, Renew(self.generation)))
            case NodeReady():
                if self.ledger.on_ready(msg) is not None:
                    self._start_generation()
                self.watchdog.progressed(self.clock.mono())
            case NodeSynced():
                if (commit := self.ledger.on_synced(msg)) is not None:
                    self._on_step(commit)
            case NodeEvaluated():
                if (evaluation := self.ledger.on_evaluated(msg)) is not None:
                    self._validated(evaluation)
            case NodeSaved():
                if (complete := self.ledger.on_saved(msg)) is not None:
                    self._commit_checkpoint(complete)
            case Standby():
                self._on_standby(msg)
            case SelfTimed():
                if msg.generation == self.generation:
                    self.reshape.timed(msg.device, msg.slowdown)
            case Dying():
                self._record_fired([msg.fault])
                if msg.fault.kind in ("node_kill", "node_hang"):  # its agent fires it once noted
                    self.dying[msg.device] = msg
                    self._emit(Send(node, Noted(self.generation, msg.device)))
            case Failed():
                self._on_failed(msg)
            case Damaged():
                self._on_damaged(msg)
            case Exited():
                cause = f"exit code {msg.exitcode}" + (" (SIGKILL)" if msg.exitcode == -signal.SIGKILL else "")
                self._on_fault({msg.device}, cause, t_fault=msg.t_fault, where={msg.device: msg.where},
                               source=msg.t_fault_source)
            case Hung():
                self._on_fault({msg.device}, f"missed heartbeats for {msg.silent_s:.1f} s (hung; fenced with SIGKILL)",
                               t_fault=msg.t_last, where={msg.device: msg.where}, source="last heartbeat")
            case Positions():
                self.watchdog.answered(node, msg)
            case FinalShards():
                self.final[msg.device] = msg.shards
            case Done():
                self.done.add(msg.device)
                self.store_ops[msg.device] = msg.store_ops
                self.peak_rss[msg.device] = msg.peak_rss
                if msg.device_reserved:
                    self.allocator_peaks[msg.device] = (msg.device_allocated, msg.device_reserved)
            case _:
                raise TrainingError(f"unexpected message {msg!r}")

    def _on_failed(self, msg: Failed) -> None:
        if msg.device_fault:
            self._on_fault({msg.device}, f"device error: {msg.error}", t_fault=self.clock.wall(),
                           where={msg.device: msg.where}, source="reported")
            return
        self._record(event="error", device=msg.device, error=msg.error, where=msg.where.to_dict(),
                     traceback=msg.traceback)  # the recorder keeps the traceback in errors.log
        log = Path(self.run_dir) / "errors.log"
        raise TrainingError(f"worker {msg.device} failed in {msg.where.describe()}: {msg.error} (traceback in {log})")

    def _on_standby(self, msg: Standby) -> None:
        """A device came back (a restarted worker or a returning node): a candidate for growing."""
        if not self.membership.back(msg.device, self.clock.wall()):
            return
        self._record(event="device_back", device=msg.device, time=self.clock.wall())

    # ----- generations and steps ------------------------------------------------------------------

    def _publish(self, plan: Plan, *, members: tuple[int, ...], resume_step: int, manifest: Manifest | None = None,
                 checkpoint=None, parcels: Parcels | None = None) -> None:
        """A new generation: each node's part of the manifest (encoded where it was decided: ``parcels``), then the
        spec to every node. ``manifest``: the transition's, or, decided in a child process, its stand-in
        (:class:`~chameleon.runtime.control.offload.Moved`: that state moves, and how much; its parts came encoded)."""
        self.generation += 1
        writers = self.coordinator.writers(plan)
        self.spec = GenerationSpec(self.generation, plan, members, resume_step, manifest, checkpoint, writers,
                                   moves=manifest is not None, evaluated=max(self.val_losses, default=-1))
        self.ledger.publish(self.generation, members=members, trainers=plan.devices, writers=writers,
                            resume_step=resume_step, replica_groups=self.coordinator.replica_groups(plan))
        self.done.clear()  # a generation after the last step (a fault in the final validation) ends anew
        self.final.clear()
        if manifest is not None:
            if parcels is None:  # never from the planning (it encodes what it decides): ``manifest`` is one
                parcels = parcel(manifest, generation=self.generation, nodes=self.nodes, node_of=self.topology.node_of)
            elif parcels.generation != self.generation:  # another generation came first
                parcels = reframed(parcels, self.generation)
            for node in self.nodes:
                self._emit(Send(node, *parcels.sends[node]))
        self.latest_publish = Publish(replace(self.spec, manifest=None))
        self._emit(Broadcast(self.latest_publish))
        self.watchdog.progressed(self.clock.mono())

    def _start_generation(self) -> None:
        self._emit(Broadcast(Begin(self.generation)))
        self.resident = self.spec.plan
        self.resident_times = self.ran.setdefault(plan_shape(self.resident), (self.resident, []))[1]
        self.reshape.resident(self.profile, self.resident)
        if self.policy.precompute:  # the likely next faults and growth need no search (the planner runs meanwhile)
            away = set(range(self.world)) - set(self.resident.devices)
            token = next(self.tokens)
            self.precomputed.submit(self.resident, token, Precompute(token, self.resident,
                                                                     frozenset(self._likely_losses()), frozenset(away)))
            self.growth.ready(set(range(self.world)) - self.membership.members, resident=self.resident, ahead=token,
                              parcel=self._parcel(), context=self._growth_context)
        now = self.clock.wall()
        self.last_commit = self.clock.mono()
        self.watchdog.progressed(self.last_commit)
        self.t_train = self.t_train or now
        self.recovery.started(now)
        self.growth.started(now)
        self.reshape.started(now)

    def _on_step(self, c: CommitStep) -> None:
        """Every node reported step ``c``: commit it, or replay it (not finite), or lose its outvoted replicas."""
        if c.outvoted:
            self._disagreed(c)
        elif c.finite:
            self._commit(c)
        else:
            self._replay(c)

    def _disagreed(self, c: CommitStep) -> None:
        """Replicas of a region disagree: the step does not commit, and the outvoted holders are lost devices (all
        of a group with no majority: the newest checkpoint arbitrates); the step is redone after the recovery."""
        self._emit(Disagreed(c.step, c.outvoted))
        self._record(event="disagreement", step=c.step, outvoted=list(c.outvoted), time=self.clock.wall())
        self._on_fault(set(c.outvoted), f"replicas' state digests disagreed before step {c.step}",
                       t_fault=self.clock.wall(), where={}, source="reported")

    def _replay(self, c: CommitStep) -> None:
        """A step that is not finite: nothing of it is applied; it is trained again, once. Not finite again on the
        same devices, and not on all, it is theirs: they are evicted (their state itself is corrupt).

        Raises:
            TrainingError: its replay was not finite either, everywhere or elsewhere (the data or the model).
        """
        self._record(event="not_finite", step=c.step, loss=str(c.loss), grad_norm=str(c.grad_norm),
                     corrupt=list(c.corrupt), replay=self.replaying is None, time=self.clock.wall())  # "nan": JSON
        persistent = self.replaying is not None and c.corrupt == self.replaying.corrupt != ()
        if persistent and set(c.corrupt) < self.ledger.trainers:
            self.replaying = None
            self._emit(NotFiniteAgain(c.step, c.loss, c.grad_norm, c.corrupt))
            self._on_fault(set(c.corrupt), f"its gradients were not finite in step {c.step} and its replay",
                           t_fault=self.clock.wall(), where={}, source="reported")
            return
        if self.replaying is not None:
            norm = c.grad_norm if c.grad_norm is None else f"{c.grad_norm:.6g}"
            found = f"devices {list(c.corrupt)} not finite" if c.corrupt else "every device finite"
            raise TrainingError(f"step {c.step} is not finite again on its replay (loss {c.loss:.6g}, gradient norm "
                                f"{norm}; {found} before the sync; the first time: devices "
                                f"{list(self.replaying.corrupt)}): the data or the model diverged, not a device: "
                                f"samples [{c.samples[0]}, {c.samples[1]}); nothing after step {c.step - 1} is "
                                "committed: lower train.lr, or check those samples")
        self.replaying = c
        self.spans.append(("redone", self._step_start(), self.clock.wall()))
        self._emit(NotFinite(c.step, c.loss, c.grad_norm, c.corrupt, c.samples))
        self._emit(Broadcast(Commit(self.generation, c.step, CommitOrder(replay=True), None, self.clock.wall())))
        self.watchdog.progressed(self.clock.mono())

    def _replayed(self, c: CommitStep) -> None:
        """The replay of a step that was not finite is: the fault was transient. Name its devices; under
        ``ft.on_corrupt=evict`` they are lost devices from now on."""
        suspects, self.replaying = self.replaying.corrupt, None
        evict = bool(suspects) and self.ft.on_corrupt == OnCorrupt.evict
        self._emit(ReplayedFinite(c.step, suspects, evict))
        self._record(event="replayed", step=c.step, suspects=list(suspects), evicted=evict, time=self.clock.wall())
        if evict:
            self._on_fault(set(suspects), f"evicted: its gradients were not finite in step {c.step}",
                           t_fault=self.clock.wall(), where={}, source="reported")

    def _commit(self, c: CommitStep) -> None:
        """Let workers apply the step, with the order for what follows; log it."""
        order, committed_in = CommitOrder(), self.generation
        steady = (self.spec.plan is self.resident and c.step >= self.spec.resume_step + STEADY_AFTER
                  and c.step not in self.val_losses)  # a validation before the step is no part of its pace
        if self.preempt and not self.stopping and not self.ledger.finished:
            order, self.stopping = CommitOrder(save=True, stop=True), True
            self._emit(Preempting(c.step))
        elif not self.ledger.finished and (grown := self.growth.ripe(self.resident, self.membership.standby,
                                                                     self.clock.wall())) is not None:
            order = CommitOrder(switch_to=self._switch(*grown))
        elif not self.ledger.finished and (reshaped := self.reshape.ripe(self.resident, self.clock.wall())) is not None:
            order = CommitOrder(switch_to=self._switch_reshape(*reshaped))
        now = self.clock.wall()
        self.last_commit_wall = now
        self._emit(Broadcast(Commit(committed_in, c.step, order, c.grad_norm, now)))
        now_m = self.clock.mono()
        dt = now_m - self.last_commit  # the whole step: compute, sync, commit, the previous optimizer step
        self.last_commit = now_m
        self.watchdog.committed(c.step, dt, now_m)
        if steady:
            self.resident_times.append(dt)
            self.reshape.judge(c.step, c.busy, self.clock.wall())
        self.recovery.paced(dt if steady else None, finished=self.ledger.finished)
        self.commit_times[c.step] = now
        self._emit(Committed(c.step, c.loss, c.samples, dt, c.compute_s, c.grad_norm,
                             learning_rate(c.step, **schedule_of(self.train)), committed_in, now, now - c.t_synced,
                             self.val_losses.get(c.step)))
        self.spans += self.recovery.committed(now, c.compute_s, generation=self.generation, finished=self.ledger.finished)
        self.spans += self.growth.committed(now, self.generation)
        self.spans += self.reshape.committed(now, dt, self.generation)
        if self.replaying is not None:
            self._replayed(c)

    def _validated(self, evaluation: Evaluation) -> None:
        now = self.clock.wall()
        self.spans.append(("evaluation", self._step_start(), now))
        self.val_losses[evaluation.step] = evaluation.loss
        self._emit(Validated(evaluation.step, evaluation.loss, self.generation, now))
        if self.ledger.finished:  # a fault in the last validation: it is redone
            self.spans += self.recovery.committed(now, None, generation=self.generation, finished=True)

    def _commit_checkpoint(self, complete: CheckpointComplete) -> None:
        self._emit(SaveCheckpoint(complete))
        self.saved = SavedState(complete.step, self.commit_times[complete.step - 1], self.ckpt_root)
        self.checkpoints = [*self.checkpoints, self.saved][-self.config.ckpt.keep:]
        self._record(event="checkpoint", step=complete.step, path=str(self.ckpt_root), generation=complete.generation)

    def _on_damaged(self, msg: Damaged) -> None:
        """A worker found the checkpoint it restores from damaged: decide again, with the checkpoint before it."""
        if msg.generation != self.generation or self.spec.checkpoint is None:
            return  # another worker said so first: already decided again
        if self.recovery.timeline is None:  # the start of a resumed run: preflight found it whole, and then it changed
            raise TrainingError(f"device {msg.device}: {msg.why}: relaunch with ckpt.resume={self.spec.checkpoint}, "
                                "which passes over a damaged checkpoint to the newest whole one")
        for damaged in [c for c in self.checkpoints if c.committed_steps >= msg.step]:
            self._emit(SetAside(damaged.root, damaged.committed_steps))
        self.checkpoints = [c for c in self.checkpoints if c.committed_steps < msg.step]
        self.saved = self.checkpoints[-1] if self.checkpoints else None
        fallback = self.saved.committed_steps if self.saved else None
        self._emit(CheckpointDamaged(msg.device, msg.why, fallback))
        self._record(event="damaged_checkpoint", device=msg.device, step=msg.step, why=msg.why, fallback=fallback,
                     time=self.clock.wall())
        self._break()
        now = self.clock.wall()
        self._decide(Loss(frozenset(), f"the checkpoint of step {msg.step} damaged", self.recovery.timeline.step, now,
                          now, "reported", {}))

    # ----- faults -------------------------------------------------------------------------------

    def _on_fault(self, devices: set[int], cause: str, *, t_fault: float, where: dict, source: str) -> None:
        """Fence the lost devices, flag the generation broken, and decide on the next generation."""
        t_detect = self.clock.wall()
        self._fence(devices)  # harmless for the dead; a returned device that fails again is dropped too
        devices = self.membership.lose(devices)
        if not devices:
            return
        self.reshape.forget(devices)
        self._break()
        step = self.ledger.next_step
        nodes = {self.topology.node_of(d) for d in devices}
        self._record_fired([f for f in self.faults if (f.rank in devices or f.node in nodes)
                            and f.step is not None and f.step <= step])
        positions = {d: (p.to_dict() if isinstance(p, Position) else None) for d, p in where.items()}
        if self.ft.on_fault == "exit":
            self._record(event="fault", failed_ranks=sorted(devices), cause=cause, t_fault=t_fault, step=step,
                         where=positions, action="exit for a relaunch")
            raise JobRestart(f"devices {sorted(devices)} lost at step {step} ({cause}); ft.on_fault=exit: "
                             f"relaunch with ckpt.resume={self.ckpt_root}")
        self.fault_times.append(t_fault - self.t0)
        self._decide(Loss(frozenset(devices), cause, step, t_fault, t_detect, source, positions))

    def _break(self) -> None:
        """Flag the generation broken to every node (once: a loss while a decision is under way finds it flagged)."""
        if not self.ledger.broken:
            self._emit(Broadcast(Flag(self.generation)))
            self.ledger.break_generation()

    def _decide(self, loss: Loss) -> None:
        """Decide how to go on from the resident plan without ``loss.devices``, resuming at ``loss.step``, once the
        events at hand are handled (:meth:`_decide_waiting`: the losses of one moment are one decision)."""
        if self.recovery.timeline is None:
            self.spans.append(("redone", self._step_start(), loss.t_fault))  # the step the fault broke
        self.recovery.lost(loss)
        self.growth.cancel()  # a fault supersedes them
        self.reshape.cancel()

    def _decide_waiting(self) -> None:
        """The loss waiting (:meth:`_decide`), decided now in the decision thread; the next generation is published
        once decided (:meth:`_decided`)."""
        loss = self.recovery.waiting
        if loss is None:
            return
        for f in self.injector.during_decision(loss.step):
            self._inject(f)
        self.recovery.decide(
            self.resident, self._precomputed(), parcel=self._parcel(), next_step=loss.step,
            fresh=None if self.t_train is not None else self.config.ckpt.resume or "", measured=self._measured(),
            speeds=self.reshape.slow, **self._context(),
        )

    def _decided(self) -> None:
        """A recovery decided in the decision thread: publish the next generation.

        Raises:
            TrainingError: no recovery is possible.
        """
        decided = self.recovery.decided(self.clock.wall(), generation=self.generation, was=self.resident,
                                        saved=self.saved)
        if decided is None:
            return
        transition, parcels = decided
        self._publish(transition.plan, members=transition.members, resume_step=transition.resume_step,
                      manifest=transition.manifest, checkpoint=transition.checkpoint, parcels=parcels)
        self.recovery.published(self.clock.wall())

    def _parcel(self) -> Parcelling:
        """What encodes, where the planning runs, every node's moves of the generation after this one."""
        return Parcelling(self.generation + 1, self.topology)

    def _step_start(self) -> float:
        """When the step under way started: the last commit, or the first step."""
        return self.last_commit_wall or self.t_train or self.clock.wall()

    def _likely_losses(self) -> set[int]:
        """How many stage units of the resident plan the likely next faults take: one device's, and those of
        one up to ``ft.fault_domain_nodes`` whole nodes (of the nodes the job has)."""
        per_node = max(1, self.per_node // geometry_of(self.resident).width)
        nodes = range(1, min(self.ft.fault_domain_nodes, self.launcher.nnodes - 1) + 1)
        return {1} | {n * per_node for n in nodes}

    def _precomputed(self) -> int | None:
        """The finished precompute for the resident plan (its token); None when none was searched for it, or its
        search has not finished or failed (a decision never waits on the planner's lane: the selector searches
        itself)."""
        search = self.precomputed.search
        if search is None or not search.stands(self.resident) or search.future.cancelled() \
                or search.future.exception() is not None:
            return None
        return search.about

    def _ahead(self) -> int | None:
        """The precompute for the resident plan (its token), finished or not (for a decision on the planner's lane,
        which runs it first)."""
        search = self.precomputed.search
        return search.about if search is not None and search.resident is self.resident else None

    def _fence(self, devices: set[int]) -> None:
        """Make sure lost devices are dead: SIGKILL through their agents, where those can be reached."""
        for device in devices:
            node = self.topology.node_of(device)
            if node in self.nodes:
                self._emit(Send(node, Signal(self.generation, device, signal.SIGKILL, "fenced")))

    def _inject(self, f: FaultSpec) -> None:
        target = f.node if f.node is not None else self.topology.node_of(f.rank)
        if target in self.nodes and (f.rank is None or self.membership.is_member(f.rank)):
            self._record_fired([f])
            self._record(event="injected", fault=f.describe(), generation=self.generation, step=self.ledger.next_step,
                         recovering=self.recovery.timeline is not None, time=self.clock.wall())
            self._emit(Send(target, Inject(self.generation, f)))

    def _record_fired(self, faults: list[FaultSpec]) -> None:
        new = [f for f in faults if f not in self.fired]
        if new:
            self.fired += new
            self._emit(Fired(tuple(self.fired)))

    def _watchdog(self, now: float) -> None:
        """No commit within the progress bound: probe, then fence the devices stuck on their own (see
        :mod:`~chameleon.runtime.control.watchdog`). A recovery being decided is no stall: the bound runs from its
        publication."""
        watching = self.generation >= 0 and not (self.ledger.finished or self.stopping or self.recovery.busy)
        bound = self.watchdog.bound(lambda: self.coordinator.step_estimate(self.resident), started=self.ledger.started)
        found = self.watchdog.check(now, bound=bound, watching=watching, generation=self.generation,
                                    nodes=len(self.nodes),
                                    silent=lambda: set(self.ledger.unreported()) & self.membership.members)
        if isinstance(found, Stuck):
            self._on_fault(found.devices, f"no progress for {found.quiet_s:.1f} s while alive and heartbeating "
                           "(stalled; fenced with SIGKILL)", t_fault=self.clock.wall() - found.quiet_s,
                           where=found.where, source="progress watchdog")
        elif found is not None:
            self._emit(Broadcast(found))

    def _settled(self) -> bool:
        """Whether a planned transition (a growth, a reshape) may be decided: training, no recovery, no stop."""
        return (self.ledger.started and not self.ledger.finished and self.recovery.timeline is None
                and not self.stopping)

    def _context(self) -> dict:
        """What every decision on the next generation is taken with (on the loop, for the deciding thread)."""
        now = self.clock.wall()
        return {"alive": set(self.membership.members), "fault_times": list(self.fault_times),
                "elapsed_s": now - self.t0, "saved": self.saved, "now": now}

    def _measured(self) -> Measured:
        """The step times measured so far, and the estimator's scale on the plan running now."""
        return Measured.of(self.ran.values(), self.resident, self.coordinator.step_estimate(self.resident))

    # ----- growing back and slow devices ------------------------------------------------------------

    def _consider_growth(self) -> None:
        """Returned devices: decide in the background whether growing onto them pays (:meth:`Grower.consider`)."""
        if self._settled():
            self.growth.consider(self.membership.standby, restarting=bool(self.membership.of(Lifecycle.restarting)),
                                 now=self.clock.wall(), resident=self.resident,
                                 ahead=self._ahead(), ready=self._precomputed() is not None, parcel=self._parcel(),
                                 context=self._growth_context)

    def _growth_context(self) -> dict:
        """What a growth is decided with: every decision's context, and the step times measured."""
        return {**self._context(), "measured": self._measured()}

    def _switch(self, grown: Transition, parcels: Parcels | None) -> int:
        """Publish the grown generation; the devices it takes in are members from now on."""
        joined = self.membership.join(grown.members)
        self.growth.switched(grown, joined, self.resident, self.clock.wall())
        self._publish(grown.plan, members=grown.members, resume_step=self.ledger.next_step, manifest=grown.manifest,
                      parcels=parcels)
        return self.generation

    def _consider_reshape(self) -> None:
        """A changed verdict on slow devices: decide in the planner's thread how to train around them (Eq. 8)."""
        if self._settled() and self.growth.timeline is None:
            self.reshape.consider(self.resident, next_step=self.ledger.next_step, times=self.resident_times,
                                  now=self.clock.wall(), parcel=self._parcel(),
                                  context=self._context)

    def _switch_reshape(self, to: Transition, parcels: Parcels | None) -> int:
        """Publish the generation chosen for slow devices."""
        self.reshape.switched(to, self.resident, next_step=self.ledger.next_step, now=self.clock.wall())
        self._publish(to.plan, members=to.members, resume_step=self.ledger.next_step, manifest=to.manifest,
                      parcels=parcels)
        return self.generation

    def close(self) -> None:
        """Cancel background planning and a recovery's decision (the end supersedes them)."""
        for background in (self.precomputed, self.growth.background, self.growth.readying, self.reshape.background):
            background.cancel()
        self.recovery.cancel()


def config_difference(ours: dict, theirs: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ between two configs (what may differ between nodes aside)."""
    out = []
    for key in sorted(set(ours) | set(theirs)):
        path = f"{prefix}{key}"
        if path in NODE_LOCAL_KEYS:
            continue
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_difference(a, b, f"{path}.")
        elif a != b:
            out.append(path)
    return out
