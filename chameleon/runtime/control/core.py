"""The controller's protocol core: events in, effects out, no sockets, no store, no files.

It owns the job's state — the :class:`~chameleon.runtime.control.ledger.Ledger` (who is
ready, which step commits, which samples trained, which checkpoint is whole), the
:class:`~chameleon.runtime.control.detector.Detector` (node leases, the stall verdict), the
:class:`~chameleon.decision.coordinator.Coordinator` (a fault or a re-join → Eq. 8 →
the next generation's plan and manifest) and the fault injector — and turns each
event into effects:

- events (:meth:`Core.handle`): a node registered (:class:`Registered`), a node's
  message (:class:`Received`), a node's link lost (:class:`Lost`), a tick
  (:class:`Tick`), a SIGTERM (:class:`Preempt`), a refused connection (:class:`Refused`);
- effects (returned): messages to one node (:class:`Send`) or every node
  (:class:`Broadcast`, encoded once), a registering agent admitted (:class:`Admit`)
  or refused (:class:`Refuse`), a link to close (:class:`Close`), and what
  the run recorder alone writes (:class:`Record`, :class:`Committed`, :class:`Say`),
  a checkpoint to commit on disk (:class:`SaveCheckpoint`), faults to remember as
  fired (:class:`Fired`).

Time comes from an injected clock, and background planning and recovery decisions
from injected executors (never the event loop's own time), so the whole protocol runs
in tests without a process (``tests/test_core.py``). ``docs/protocol.md`` gives it as a state table.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from concurrent.futures import Executor, Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from chameleon.config import Config, OnCorrupt, SlowPolicy, pipelines_allowed
from chameleon.decision.config import PolicyConfig
from chameleon.decision.coordinator import Coordinator, NoRecovery, SavedState, Transition
from chameleon.decision.estimator import device_work
from chameleon.decision.measured import Measured, plan_shape
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import Profile
from chameleon.decision.selector import Decision, precompute_replans
from chameleon.faults.spec import FaultSpec, Injector, controller_faults
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import Manifest, manifest_parts
from chameleon.optim import learning_rate, schedule_of
from chameleon.report.breakdown import Span
from chameleon.runtime.control.detector import Detector, stall
from chameleon.runtime.control.ledger import CheckpointComplete, CommitStep, Evaluation, Ledger
from chameleon.runtime.control.membership import Lifecycle, Membership
from chameleon.runtime.control.stragglers import Stragglers
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
    Moves,
    NodeEvaluated,
    NodeReady,
    NodeSaved,
    NodeSynced,
    Noted,
    Positions,
    Probe,
    Publish,
    Renew,
    SelfTimed,
    Signal,
    Standby,
    Start,
    Welcome,
)
from chameleon.runtime.protocol.position import Position
from chameleon.runtime.protocol.timeouts import Timeouts
from chameleon.runtime.protocol.topology import Topology

GROW_SETTLE_S = 0.5  # wait for more returning devices this long after the last one
STEADY_AFTER = 2  # a generation's first steps (restore, warm-up) are left out of its plan's measured step time
PACE_STEPS = 3  # a recovery's estimate is compared with the median of this many steady steps after it
PROBE_WAIT_S = 1.0  # the watchdog decides with the answers it has by then
LEASE_CHECK_S = 0.05  # leases are checked this often (a lapse is seen at most this late)
NODE_LOCAL_KEYS = ("launcher.node_rank", "launcher.node_addr", "output", "report")  # may differ between nodes


# ----- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Registered:
    """A node's agent proved the secret and said hello."""

    hello: Hello


@dataclass(frozen=True)
class Received:
    """A message from node ``node``'s agent (in-process on node 0)."""

    node: int
    message: object


@dataclass(frozen=True)
class Lost:
    """Node ``node``'s link closed or failed verification."""

    node: int
    cause: str


@dataclass(frozen=True)
class Refused:
    """A connection that could not prove the secret."""

    why: str


@dataclass(frozen=True)
class Tick:
    """Time passed (leases, the watchdog, timed faults, growth).

    ``heard_at``: when the controller last read every link (monotonic; None: now). Leases are judged on the
    silence up to then, never on time the controller itself spent between that reading and this tick.
    """

    heard_at: float | None = None


@dataclass(frozen=True)
class Preempt:
    """SIGTERM: save a checkpoint at the next step boundary, then stop."""


# ----- effects ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    node: int
    message: object


@dataclass(frozen=True)
class Admit:
    """Bind the registering agent's link to ``node`` and welcome it (the same node again: a return)."""

    node: int
    welcome: Welcome | None  # None for node 0's agent, in the controller's own process


@dataclass(frozen=True)
class Refuse:
    """Answer the registering agent's link with ``why`` and close it."""

    why: str


@dataclass(frozen=True)
class Broadcast:
    """The same message to every node (encoded once)."""

    message: object


@dataclass(frozen=True)
class Close:
    """Drop node ``node``'s link (its agent, if alive, finds its lease lapsed and fences its workers)."""

    node: int


@dataclass(frozen=True)
class Record:
    """A line of ``events.jsonl``."""

    event: dict


@dataclass(frozen=True)
class Say:
    """A line for the user (stderr)."""

    text: str


@dataclass(frozen=True)
class Committed:
    """A committed step, for ``metrics.jsonl``, the progress bar and the summary."""

    step: int
    loss: float
    samples: tuple[int, int]
    step_time_s: float
    compute_s: float
    grad_norm: float | None
    lr: float
    generation: int
    time: float
    commit_s: float  # the commit's publication after the slowest trainer synced (clocks of one host)
    val_loss: float | None = None  # the validation loss of the parameters this step trained from, where taken


@dataclass(frozen=True)
class Validated:
    """The validation loss before ``step`` (``step == train.steps``: after the last), for the recorder."""

    step: int
    loss: float
    generation: int
    time: float


@dataclass(frozen=True)
class SaveCheckpoint:
    """Every writer saved its part: commit the checkpoint on disk."""

    complete: CheckpointComplete


@dataclass(frozen=True)
class SetAside:
    """A checkpoint found damaged: move it out of the way of readers and of its step's next save."""

    root: Path
    step: int


@dataclass(frozen=True)
class Fired:
    """Faults fired so far: remembered in the checkpoint root, so a relaunch never fires them again."""

    faults: tuple[FaultSpec, ...]


class Clock:
    """Wall-clock and monotonic time (a test gives a clock of its own)."""

    wall = staticmethod(time.time)
    mono = staticmethod(time.monotonic)


# ----- timelines -------------------------------------------------------------------------------


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
    t_published: float = 0.0
    t_started: float = 0.0
    t_first_commit: float = 0.0
    decision: Decision | None = None
    manifest_bytes: int = 0
    manifest_rounds: int = 0
    estimated_step_s: float = 0.0
    first_step_s: float | None = 0.0  # None: no step followed (a fault in the last validation)
    steady_step_s: float | None = None  # the median of the first steady steps after it (warm-up left out)

    def record(self) -> dict:
        return {
            "failed_ranks": self.failed, "cause": self.cause, "step": self.step, "where": self.where,
            "chosen": self.decision.choice, "t_fault_source": self.t_fault_source,
            "detect_s": self.t_detect - self.t_fault, "decide_s": self.t_decided - self.t_detect,
            "publish_s": self.t_published - self.t_decided,
            "restore_s": self.t_started - self.t_decided, "redo_s": self.t_first_commit - self.t_started,
            "total_s": self.t_first_commit - self.t_fault, "manifest_bytes": self.manifest_bytes,
            "manifest_rounds": self.manifest_rounds, "first_step_s": self.first_step_s,
            "estimated_step_s": self.estimated_step_s, "steady_step_s": self.steady_step_s, "d_s": self.decision.d_s,
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
    decision: Decision | None = None
    plan: str = ""
    manifest_bytes: int = 0
    estimated_step_s: float = 0.0

    def record(self) -> dict:
        return {
            "devices": self.devices, "chosen": self.decision.choice, "plan": self.plan,
            "decide_s": self.t_decided - self.t_back, "switch_wait_s": self.t_switch - self.t_decided,
            "restore_s": self.t_started - self.t_switch, "first_step_s": self.t_first_commit - self.t_started,
            "total_s": self.t_first_commit - self.t_back, "manifest_bytes": self.manifest_bytes,
            "estimated_step_s": self.estimated_step_s,
        }


@dataclass
class Reshape:
    """Timeline of a decision on slow devices (``speeds``; empty: all back to speed), from the verdict to the first
    step committed on the plan it chose (none, when it tolerates)."""

    speeds: dict[int, float]
    step: int
    t_judged: float
    t_decided: float = 0.0
    t_switch: float = 0.0
    t_started: float = 0.0
    t_first_commit: float = 0.0
    decision: Decision | None = None
    plan: str = ""
    estimated_step_s: float = 0.0
    first_step_s: float = 0.0

    def record(self) -> dict:
        return {
            "slow": {str(d): f for d, f in sorted(self.speeds.items())}, "step": self.step,
            "chosen": self.decision.choice, "plan": self.plan, "decide_s": self.t_decided - self.t_judged,
            "switch_wait_s": self.t_switch - self.t_decided if self.t_switch else None,
            "restore_s": self.t_started - self.t_switch if self.t_switch else None,
            "estimated_step_s": self.estimated_step_s, "first_step_s": self.first_step_s,
        }


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


@dataclass
class Search:
    """Planning under way in a background thread, for the plan resident when it began, and what it is about: the
    devices a growth would take in, the slow devices a reshape plans around with their factors, the loss a
    recovery decides on."""

    resident: Plan
    future: Future
    about: object

    def stands(self, resident: Plan) -> bool:
        """Whether it was searched for ``resident`` and has finished."""
        return self.resident is resident and self.future.done()


class Background:
    """One kind of planning in an executor's thread, one search at a time: submitted, then polled until it has
    finished and taken. A new search or a cancel supersedes the one before: queued, it never runs; under way, it
    finishes unheard."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.search: Search | None = None

    @property
    def busy(self) -> bool:
        return self.search is not None

    def submit(self, resident: Plan, about: object, fn, /, *args, **kwargs) -> None:
        self.cancel()
        self.search = Search(resident, self.executor.submit(fn, *args, **kwargs), about)

    def finished(self) -> Search | None:
        """The search, taken, once it has finished; None while it runs, or when there is none."""
        if self.search is None or not self.search.future.done():
            return None
        search, self.search = self.search, None
        return search

    def cancel(self) -> None:
        if self.search is not None:
            self.search.future.cancel()
            self.search = None


@dataclass(frozen=True)
class Loss:
    """What a recovery decides on: the devices lost (none: the same members, decided anew), why, the step it
    resumes at, and when the loss happened and was detected."""

    devices: frozenset[int]
    cause: str
    step: int
    t_fault: float
    t_detect: float
    source: str
    where: dict

    def then(self, later: Loss) -> Loss:
        """This loss and ``later``, which came while this one was being decided: one decision for both."""
        return replace(self, devices=self.devices | later.devices, cause=f"{self.cause}; then {later.cause}",
                       where={**self.where, **later.where})


def recover(coordinator: Coordinator, precomputed: Future | None, resident: Plan, /, *, alive: set[int],
            **kwargs) -> Transition:
    """:meth:`Coordinator.recover`, in the decision thread, from the precomputed shape for what survives, placed
    (``precomputed``: the finished precompute for ``resident``, if any; one that fails is a missing one)."""
    placed = None
    if precomputed is not None:
        units = geometry_of(resident).units(alive)  # the units the selector re-plans onto
        with contextlib.suppress(Exception):  # a failed precompute is a missing one
            placed = precomputed.result().plan_for(units, resident, coordinator.profile)
    return coordinator.recover(resident, alive=alive, precomputed=placed, **kwargs)


@dataclass
class _Probe:
    id: int
    sent: float
    answers: dict[int, dict] = field(default_factory=dict)


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
        clock: time.
    """

    def __init__(self, config: Config, *, plan: Plan, profile: Profile, run_dir: str, store_port: int, ckpt_root: Path,
                 saved: SavedState | None, faults: list[FaultSpec], fired: list[FaultSpec], planner: Executor,
                 decider: Executor, clock: Clock = Clock()):
        self.config, self.run_dir, self.store_port, self.clock = config, run_dir, store_port, clock
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
        self.declined: frozenset[int] = frozenset()
        self.done: set[int] = set()
        self.store_ops: dict[int, int] = {}  # per device that finished: its operations on the store
        self.peak_rss: dict[int, int] = {}  # per device that finished: its peak resident memory, bytes
        self.final: dict[int, dict] = {}
        self.ran: dict[tuple, tuple[Plan, list[float]]] = {}  # by plan shape: the plan and its steady step times
        self.resident_times: list[float] = []
        self.commit_times: dict[int, float] = {}
        self.val_losses: dict[int, float] = {}  # by step: the validation loss before it
        self.step_times: dict[int, float] = {}
        self.recoveries: list[Recovery] = []
        self.growths: list[Growth] = []
        self.pending: Recovery | None = None
        self.pacing: tuple[Recovery, list[float]] | None = None  # a recovery closed, its steady steps being timed
        self.growing: Growth | None = None
        self.fault_times: list[float] = []
        self.dying: dict[int, Dying] = {}
        self.replaying: CommitStep | None = None  # the step that was not finite, while its replay runs
        self.nodes: dict[int, NodeInfo] = {}
        self.preempt = self.stopping = False
        self.t0 = clock.wall()
        self.t_train: float | None = None
        self.join_deadline = clock.mono() + self.launcher.join_timeout_s
        self.last_commit = self.last_progress = self.leases_checked = clock.mono()
        self.probe: _Probe | None = None
        self.probes = 0
        self.precomputed = Background(planner)
        self.growth = Background(planner)
        self.deciding = Background(decider)  # a recovery's decision, from the fault to its publication
        self.stragglers = (Stragglers(ratio=self.ft.slow_ratio, window=self.ft.slow_window)
                           if self.ft.slow == SlowPolicy.on else None)
        self.work: dict[int, float] = {}  # each trainer's compute per step under the resident plan, as modelled
        self.roles: dict[int, tuple[int, int]] = {}  # each trainer's layers under the resident plan
        self.self_timed: dict[int, float] = {}  # idle members' slowdowns reported since the last commit
        self.reshaping = Background(planner)
        self.reshape_due = False  # the verdict on slow devices changed since the last decision on it
        self.reshape_after = 0  # no decision on slow devices before this step: the last one stands its cost's worth
        self.reshapes: list[Reshape] = []
        self.reshaped: Reshape | None = None  # a switch for slow devices, until its first commit
        self.spans: list[Span] = []  # the run's time that was not training (report.breakdown)
        self.last_commit_wall: float | None = None
        self.out: list[object] = []

    def _cost_model(self, *, devices_per_host: int) -> None:
        """Profile, planner and coordinator for this launch's topology.

        A measured profile is cached per model and host; how many of this job's devices share a
        host's cores is this launch's: a node's, or the whole job's when every node runs on one host.
        """
        profile = self.measured_profile
        if profile.host_cores:
            profile = replace(profile, n_devices=self.world, devices_per_node=devices_per_host)
        self.profile = profile
        lengths = tuple(self.policy.pp_lengths) if pipelines_allowed(self.launcher) else (1,)
        self.planner_ = Planner(profile, dp_degrees=tuple(self.policy.dp_degrees), pp_lengths=lengths)
        nodes = self.launcher.nnodes
        domains = tuple(self.topology.devices_of(n) for n in range(nodes)) if nodes > 1 else None
        self.coordinator = Coordinator(model=self.config.model, profile=profile, planner=self.planner_,
                                       policy=self.policy, checkpoint_steps=self.config.ckpt.interval, domains=domains)

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
            case Preempt():
                self.preempt = True
            case _:
                raise TypeError(f"unexpected event {event!r}")
        self._decided()
        return self.out

    @property
    def over(self) -> bool:
        """Every member still alive reported done, after the last step or a stop (and no recovery is being decided)."""
        finishing = (self.ledger.finished or self.stopping) and not self.deciding.busy
        return finishing and (set(self.ledger.members) & self.membership.members) <= self.done

    def _emit(self, *effects: object) -> None:
        self.out.extend(effects)

    def _say(self, text: str) -> None:
        self._emit(Say(text))

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
            if self.latest_publish is not None:  # the returning node's standby workers learn the newest generation
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
        self._say(f"chameleon: refused a connection: {why}")
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
                self.last_progress = self.clock.mono()
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
                    self.self_timed[msg.device] = msg.slowdown
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
                if self.probe is not None and msg.probe == self.probe.id:
                    self.probe.answers[node] = msg.positions
            case FinalShards():
                self.final[msg.device] = msg.shards
            case Done():
                self.done.add(msg.device)
                self.store_ops[msg.device] = msg.store_ops
                self.peak_rss[msg.device] = msg.peak_rss
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

    def _publish(self, plan: Plan, *, members: tuple[int, ...], resume_step: int, manifest=None, checkpoint=None) -> None:
        """A new generation: each node's part of the manifest, then the spec to every node."""
        self.generation += 1
        writers = self.coordinator.writers(plan)
        self.spec = GenerationSpec(self.generation, plan, members, resume_step, manifest, checkpoint, writers,
                                   moves=manifest is not None, evaluated=max(self.val_losses, default=-1))
        self.ledger.publish(self.generation, members=members, trainers=plan.devices, writers=writers,
                            resume_step=resume_step, replica_groups=self.coordinator.replica_groups(plan))
        self.done.clear()  # a generation after the last step (a fault in the final validation) ends anew
        self.final.clear()
        if manifest is not None:
            parts = manifest_parts(manifest, self.topology.node_of)
            empty = Manifest((), tuple(() for _ in manifest.rounds), {}, {})
            for node in self.nodes:
                self._emit(Send(node, Moves(self.generation, parts.get(node, empty))))
        self.latest_publish = Publish(replace(self.spec, manifest=None))
        self._emit(Broadcast(self.latest_publish))
        self.last_progress = self.clock.mono()

    def _start_generation(self) -> None:
        self._emit(Broadcast(Begin(self.generation)))
        self.resident = self.spec.plan
        self.resident_times = self.ran.setdefault(plan_shape(self.resident), (self.resident, []))[1]
        self.work = device_work(self.profile, self.resident)
        self.roles = {d: st.layers for p in self.resident.pipelines for st in p.stages for d in st.devices}
        if self.stragglers is not None:
            self.stragglers.restart()
        if self.policy.precompute:  # the likely next faults need no search (the planner runs meanwhile)
            self.precomputed.submit(self.resident, None, precompute_replans, self.resident, self.planner_,
                                    self._likely_losses())
        now = self.clock.wall()
        self.last_commit = self.last_progress = self.clock.mono()
        self.t_train = self.t_train or now
        for timeline in (self.pending, self.growing):
            if timeline is not None:
                timeline.t_started = now
        if self.reshaped is not None and self.reshaped.t_switch:
            self.reshaped.t_started = now

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
        self._say(f"chameleon: replicas disagree before step {c.step}: devices {list(c.outvoted)} are outvoted by "
                  "their replicas' digests (with no majority, every holder is): not committed; they are lost devices")
        self._record(event="disagreement", step=c.step, outvoted=list(c.outvoted), time=self.clock.wall())
        self._on_fault(set(c.outvoted), f"replicas' state digests disagreed before step {c.step}",
                       t_fault=self.clock.wall(), where={}, source="reported")

    def _replay(self, c: CommitStep) -> None:
        """A step that is not finite: nothing of it is applied; it is trained again, once. Not finite again on the
        same devices, and not on all, it is theirs: they are evicted (their state itself is corrupt).

        Raises:
            TrainingError: its replay was not finite either, everywhere or elsewhere (the data or the model).
        """
        what = (f"loss {c.loss:.6g}, gradient norm {c.grad_norm if c.grad_norm is None else f'{c.grad_norm:.6g}'}; "
                + (f"devices {list(c.corrupt)} not finite before the sync" if c.corrupt
                   else "every device finite before the sync"))
        samples = f"samples [{c.samples[0]}, {c.samples[1]})"
        self._record(event="not_finite", step=c.step, loss=str(c.loss), grad_norm=str(c.grad_norm),
                     corrupt=list(c.corrupt), replay=self.replaying is None, time=self.clock.wall())  # "nan": JSON
        persistent = self.replaying is not None and c.corrupt == self.replaying.corrupt != ()
        if persistent and set(c.corrupt) < self.ledger.trainers:
            self.replaying = None
            self._say(f"chameleon: step {c.step} is not finite again on its replay, on the same devices "
                      f"{list(c.corrupt)} alone ({what}): their state is corrupt; they are evicted")
            self._on_fault(set(c.corrupt), f"its gradients were not finite in step {c.step} and its replay",
                           t_fault=self.clock.wall(), where={}, source="reported")
            return
        if self.replaying is not None:
            raise TrainingError(f"step {c.step} is not finite again on its replay ({what}; the first time: devices "
                                f"{list(self.replaying.corrupt)}): the data or the model diverged, not a device: "
                                f"{samples}; nothing after step {c.step - 1} is committed: lower train.lr, or check "
                                "those samples")
        self.replaying = c
        self.spans.append(("redone", self._step_start(), self.clock.wall()))
        self._say(f"chameleon: step {c.step} is not finite ({what}): not committed; replaying it ({samples})")
        self._emit(Broadcast(Commit(self.generation, c.step, CommitOrder(replay=True), None, self.clock.wall())))
        self.last_progress = self.clock.mono()

    def _replayed(self, c: CommitStep) -> None:
        """The replay of a step that was not finite is: the fault was transient. Name its devices; under
        ``ft.on_corrupt=evict`` they are lost devices from now on."""
        suspects, self.replaying = self.replaying.corrupt, None
        evict = bool(suspects) and self.ft.on_corrupt == OnCorrupt.evict
        who = (f"devices {list(suspects)}, whose own gradients were not finite, "
               + ("are evicted" if evict else "stay (ft.on_corrupt=replay)") if suspects
               else "no device's own gradients were not finite")
        self._say(f"chameleon: step {c.step} replayed finite: the fault was transient; {who}")
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
            self._say(f"chameleon: SIGTERM: saving a checkpoint after step {c.step}, then stopping")
        elif not self.ledger.finished and (grown := self._ripe_growth()) is not None:
            order = CommitOrder(switch_to=self._switch(grown))
        elif not self.ledger.finished and (reshaped := self._ripe_reshape()) is not None:
            order = CommitOrder(switch_to=self._switch_reshape(reshaped))
        now = self.clock.wall()
        self.last_commit_wall = now
        self._emit(Broadcast(Commit(committed_in, c.step, order, c.grad_norm, now)))
        now_m = self.clock.mono()
        dt = now_m - self.last_commit  # the whole step: compute, sync, commit, the previous optimizer step
        self.last_commit = self.last_progress = now_m
        self.step_times[c.step] = dt
        if steady:
            self.resident_times.append(dt)
            self._judge_speeds(c)
            if self.pacing is not None:
                self.pacing[1].append(dt)
        if self.pacing is not None and (len(self.pacing[1]) >= PACE_STEPS or self.ledger.finished):
            self._say_pace()
        self.commit_times[c.step] = now
        self._emit(Committed(c.step, c.loss, c.samples, dt, c.compute_s, c.grad_norm,
                             learning_rate(c.step, **schedule_of(self.train)), committed_in, now, now - c.t_synced,
                             self.val_losses.get(c.step)))
        if self.pending is not None:
            self._close_recovery(now, c.compute_s)
        if self.growing is not None and self.growing.t_started:
            self._close_growth(now)
        if self.reshaped is not None and self.reshaped.t_started:
            self._close_reshape(now, dt)
        if self.replaying is not None:
            self._replayed(c)

    def _validated(self, evaluation: Evaluation) -> None:
        now = self.clock.wall()
        self.spans.append(("evaluation", self._step_start(), now))
        self.val_losses[evaluation.step] = evaluation.loss
        self._emit(Validated(evaluation.step, evaluation.loss, self.generation, now))
        if self.pending is not None and self.ledger.finished:  # a fault in the last validation: it is redone
            self._close_recovery(now, None)

    def _commit_checkpoint(self, complete: CheckpointComplete) -> None:
        self._emit(SaveCheckpoint(complete))
        self.saved = SavedState(complete.step, self.commit_times[complete.step - 1], self.ckpt_root)
        self.checkpoints = [*self.checkpoints, self.saved][-self.config.ckpt.keep:]
        self._record(event="checkpoint", step=complete.step, path=str(self.ckpt_root), generation=complete.generation)

    def _on_damaged(self, msg: Damaged) -> None:
        """A worker found the checkpoint it restores from damaged: decide again, with the checkpoint before it."""
        if msg.generation != self.generation or self.spec.checkpoint is None:
            return  # another worker said so first: already decided again
        if self.pending is None:  # the start of a resumed run: preflight found it whole, and then it changed
            raise TrainingError(f"device {msg.device}: {msg.why}: relaunch with ckpt.resume={self.spec.checkpoint}, "
                                "which passes over a damaged checkpoint to the newest whole one")
        for damaged in [c for c in self.checkpoints if c.committed_steps >= msg.step]:
            self._emit(SetAside(damaged.root, damaged.committed_steps))
        self.checkpoints = [c for c in self.checkpoints if c.committed_steps < msg.step]
        self.saved = self.checkpoints[-1] if self.checkpoints else None
        older = (f"the checkpoint of step {self.saved.committed_steps} is the newest whole one" if self.saved
                 else "no older checkpoint of this run is left")
        self._say(f"chameleon: device {msg.device} found the checkpoint it restores damaged: {msg.why}; {older}")
        self._record(event="damaged_checkpoint", device=msg.device, step=msg.step, why=msg.why,
                     fallback=self.saved.committed_steps if self.saved else None, time=self.clock.wall())
        self._break()
        now = self.clock.wall()
        self._decide(Loss(frozenset(), f"the checkpoint of step {msg.step} damaged", self.pending.step, now, now,
                          "reported", {}))

    def _close_recovery(self, now: float, step_s: float | None) -> None:
        """The first commit after a fault (``step_s``: its compute), or the last validation redone (None)."""
        rec, self.pending = self.pending, None
        rec.t_first_commit, rec.first_step_s = now, step_s
        self.recoveries.append(rec)
        self.spans += [("detection", rec.t_fault, rec.t_detect), ("decision", rec.t_detect, rec.t_decided),
                       ("restore", rec.t_decided, rec.t_started)]
        self._record(event="recovered", generation=self.generation, time=now, **rec.record())
        self.pacing = rec, []
        if step_s is None or self.ledger.finished:
            self._say_pace()

    def _say_pace(self) -> None:
        """The recovery line, once the steady step after it is known (or nothing more will be): the estimate is
        compared with the median of the steady steps after warm-up, not with the first (restore, warm-up)."""
        (rec, times), self.pacing = self.pacing, None
        if times:
            rec.steady_step_s = sorted(times)[len(times) // 2]
            pace = f"steady step {rec.steady_step_s:.3f} s vs {rec.estimated_step_s:.3f} s estimated"
        else:
            pace = ("the last validation redone" if rec.first_step_s is None
                    else f"no steady step followed; estimated {rec.estimated_step_s:.3f} s")
        self._say(
            f"chameleon: recovered from the loss of {rec.failed} by {rec.decision.choice} in "
            f"{rec.t_first_commit - rec.t_fault:.3f} s (detect {rec.t_detect - rec.t_fault:.3f}, decide "
            f"{rec.t_decided - rec.t_detect:.3f}, restore {rec.t_started - rec.t_decided:.3f}, redo "
            f"{rec.t_first_commit - rec.t_started:.3f}); {pace}"
        )

    # ----- faults -------------------------------------------------------------------------------

    def _on_fault(self, devices: set[int], cause: str, *, t_fault: float, where: dict, source: str) -> None:
        """Fence the lost devices, flag the generation broken, and decide on the next generation."""
        t_detect = self.clock.wall()
        self._fence(devices)  # harmless for the dead; a returned device that fails again is dropped too
        devices = self.membership.lose(devices)
        if not devices:
            return
        if self.stragglers is not None:
            self.stragglers.forget(devices)
            self.reshape_due = bool(self.stragglers.slow)  # decided afresh on the plan the recovery brings
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
        """Decide, in the decision thread, how to go on from the resident plan without ``loss.devices``, resuming at
        ``loss.step``; the next generation is published once decided (:meth:`_decided`). A decision still under way
        is superseded: it did not know of this loss, and decides nothing any more."""
        if self.pacing is not None:
            self._say_pace()  # a new fault: the last one's pace is what it was
        if self.pending is None:
            self.pending = Recovery(sorted(loss.devices), loss.cause, loss.step, loss.t_fault, loss.t_detect,
                                    loss.source, loss.where)
            self.spans.append(("redone", self._step_start(), loss.t_fault))  # the step the fault broke
        else:
            self.pending.failed = sorted(set(self.pending.failed) | loss.devices)
            self.pending.cause += f"; then {loss.cause} during recovery"
            self.pending.where.update(loss.where)
        if self.deciding.busy:
            loss = self.deciding.search.about.then(loss)
        self.growing = self.reshaped = None
        self.growth.cancel()  # a fault supersedes them; a search under way finishes unheard
        self.reshaping.cancel()
        for f in self.injector.during_decision(loss.step):
            self._inject(f)
        now = self.clock.wall()
        self.deciding.submit(
            self.resident, loss, recover, self.coordinator, self._precomputed(), self.resident,
            alive=set(self.membership.members), next_step=loss.step, saved=self.saved, now=now,
            fault_times=list(self.fault_times), elapsed_s=now - self.t0,
            fresh=None if self.t_train is not None else self.config.ckpt.resume or "", measured=self._measured(),
            speeds=dict(self.stragglers.slow) if self.stragglers is not None else {},
        )
        self._decided()

    def _decided(self) -> None:
        """A recovery decided in the decision thread: say so and publish the next generation.

        Raises:
            TrainingError: no recovery is possible.
        """
        search = self.deciding.finished()
        if search is None:
            return
        loss: Loss = search.about
        try:
            transition: Transition = search.future.result()
        except NoRecovery as err:
            raise TrainingError(str(err)) from None
        rec = self.pending
        rec.t_decided, rec.decision = self.clock.wall(), transition.decision
        rec.estimated_step_s = transition.estimated_step_s
        if transition.manifest is not None:
            rec.manifest_bytes, rec.manifest_rounds = transition.manifest.wire_bytes, len(transition.manifest.rounds)
        self._record(event="fault", generation=self.generation, failed_ranks=sorted(loss.devices), cause=loss.cause,
                     step=loss.step, where=loss.where, t_fault=loss.t_fault, t_fault_source=loss.source,
                     detect_s=loss.t_detect - loss.t_fault, decide_s=rec.t_decided - loss.t_detect,
                     decision=rec.decision.to_dict(), manifest_bytes=rec.manifest_bytes,
                     manifest_rounds=rec.manifest_rounds)
        victims = "; ".join(f"device {d}: {p['where']}" for d, p in loss.where.items() if p)
        reload = ""
        if transition.checkpoint:
            reload = (f"reloading the checkpoint of step {transition.resume_step} "
                      f"({loss.t_detect - self.saved.committed_at:.1f} s of progress lost)\n")
        what = f"devices {sorted(loss.devices)} lost" if loss.devices else "deciding again"
        self._say(f"\nchameleon: {what} at step {loss.step} ({loss.cause})"
                  + (f"\n  where: {victims}" if victims else "")
                  + f"\n{transition.decision.table()}\n{reload}new plan:\n{transition.plan.summary(self.resident)}")
        self._publish(transition.plan, members=transition.members, resume_step=transition.resume_step,
                      manifest=transition.manifest, checkpoint=transition.checkpoint)
        rec.t_published = self.clock.wall()

    def _step_start(self) -> float:
        """When the step under way started: the last commit, or the first step."""
        return self.last_commit_wall or self.t_train or self.clock.wall()

    def _likely_losses(self) -> set[int]:
        """How many stage units of the resident plan the likely next faults take: one device's, and those of
        one up to ``ft.fault_domain_nodes`` whole nodes (of the nodes the job has)."""
        per_node = max(1, self.per_node // geometry_of(self.resident).width)
        nodes = range(1, min(self.ft.fault_domain_nodes, self.launcher.nnodes - 1) + 1)
        return {1} | {n * per_node for n in nodes}

    def _precomputed(self) -> Future | None:
        """The finished precompute for the resident plan; None when none was searched for it, or its search has not
        finished (a decision never waits on the planner's thread: the selector searches itself)."""
        search = self.precomputed.search
        return search.future if search is not None and search.stands(self.resident) else None

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
                         recovering=self.pending is not None, time=self.clock.wall())
            self._emit(Send(target, Inject(self.generation, f)))

    def _record_fired(self, faults: list[FaultSpec]) -> None:
        new = [f for f in faults if f not in self.fired]
        if new:
            self.fired += new
            self._emit(Fired(tuple(self.fired)))

    def _watchdog(self, now: float) -> None:
        """No commit within the progress bound: ask where everyone is, then fence the devices stuck on their
        own, or stop naming the silent ones. A recovery being decided is no stall: the bound runs from its
        publication."""
        bound = self.stall_bound()
        quiet = now - self.last_progress
        if self.generation < 0 or quiet <= bound or self.ledger.finished or self.stopping or self.deciding.busy:
            self.probe = None
            return
        if self.probe is None:
            self.probes += 1
            self.probe = _Probe(self.probes, now)
            self._emit(Broadcast(Probe(self.generation, self.probe.id)))
            return
        if len(self.probe.answers) < len(self.nodes) and now - self.probe.sent < PROBE_WAIT_S:
            return
        answers, self.probe = self.probe.answers, None
        positions = {d: p for per_node in answers.values() for d, p in per_node.items()}
        silent = set(self.ledger.unreported()) & self.membership.members
        found = stall(silent, positions, bound_s=bound)
        if found.stuck:
            where = {d: found.silent[d] for d in found.stuck}
            self._on_fault(set(found.stuck), f"no progress for {quiet:.1f} s while alive and heartbeating (stalled; "
                           "fenced with SIGKILL)", t_fault=self.clock.wall() - quiet, where=where,
                           source="progress watchdog")
            return
        if found.suspects:  # still for less than the bound so far: proven stuck, or moving again, soon
            return
        raise TrainingError(
            f"no step committed for {quiet:.0f} s (bound {bound:.0f} s) and no device is stuck on its own; "
            f"devices that have not reported: {found.describe() or 'none'}"
        )

    def stall_bound(self) -> float:
        """How long the job may go without progress: ``ft.stall_timeout_s``, else derived from the step time.

        Until a generation starts (workers starting, groups connecting, state moving) the backend's
        own timeout bounds every wait, so the bound is at least ``launcher.timeout_s``; so it is
        throughout under ``train.compile``, where a device meeting a new stage shape compiles for a while.
        """
        bound = self.ft.stall_timeout_s
        if bound is None:
            expected = self.coordinator.step_estimate(self.resident)
            if self.step_times:
                recent = sorted(list(self.step_times.values())[-20:])
                expected = max(expected, recent[len(recent) // 2])
            bound = max(self.ft.stall_min_s, self.ft.stall_factor * expected)
        return bound if self.ledger.started and not self.train.compile else max(bound, self.launcher.timeout_s)

    # ----- growing back ---------------------------------------------------------------------------

    def _consider_growth(self) -> None:
        """Returned devices: decide in the planner's thread whether growing onto them pays."""
        standby = self.membership.standby
        joining = frozenset(standby)
        if not joining or joining == self.declined or self.growth.busy or self.stopping:
            return
        settling = self.clock.wall() - max(standby.values()) < GROW_SETTLE_S
        if settling and self.membership.of(Lifecycle.restarting):
            return  # a node's devices come back together: wait a moment for the rest
        if not self.ledger.started or self.ledger.finished or self.pending is not None:
            return
        self.growth.submit(
            self.resident, joining, self.coordinator.grow, self.resident, alive=set(self.membership.members),
            joining=set(joining), fault_times=list(self.fault_times), elapsed_s=self.clock.wall() - self.t0,
            saved=self.saved, now=self.clock.wall(), measured=self._measured(),
        )

    def _measured(self) -> Measured:
        """The step times measured so far, and the estimator's scale on the plan running now."""
        return Measured.of(self.ran.values(), self.resident, self.coordinator.step_estimate(self.resident))

    def _ripe_growth(self) -> Transition | None:
        """A decided growth, if it is ready and still stands (same plan, same devices back)."""
        growth = self.growth.finished()
        if growth is None:
            return None
        joining = growth.about
        standby = self.membership.standby
        if not growth.stands(self.resident) or not joining <= set(standby):
            return None
        outcome: Transition | Decision = growth.future.result()
        t_back = min(standby[d] for d in joining)
        if isinstance(outcome, Decision):
            self.declined = joining
            self._record(event="growth", devices=sorted(joining), choice=outcome.choice, decision=outcome.to_dict())
            self._say(f"chameleon: devices {sorted(joining)} are back; growing does not pay now\n{outcome.table()}")
            return None
        self.growing = Growth(sorted(joining), t_back, t_decided=self.clock.wall(), decision=outcome.decision,
                              plan=outcome.plan.describe(), estimated_step_s=outcome.estimated_step_s,
                              manifest_bytes=outcome.manifest.wire_bytes if outcome.manifest else 0)
        return outcome

    def _switch(self, grown: Transition) -> int:
        """Publish the grown generation; the devices it takes in are members from now on."""
        joined = self.membership.join(grown.members)
        self.growing.t_switch = self.clock.wall()
        self._say(f"chameleon: devices {sorted(joined)} are back: growing\n{grown.decision.table()}\n"
                  f"new plan:\n{grown.plan.summary(self.resident)}")
        self._publish(grown.plan, members=grown.members, resume_step=self.ledger.next_step, manifest=grown.manifest)
        return self.generation

    def _close_growth(self, now: float) -> None:
        g, self.growing = self.growing, None
        g.t_first_commit = now
        self.growths.append(g)
        self.spans.append(("restore", g.t_switch, g.t_started))
        self._record(event="grown", generation=self.generation, time=now, **g.record())
        self._say(f"chameleon: grew onto devices {g.devices} in {g.t_first_commit - g.t_back:.3f} s after they came back "
                  f"(decide {g.t_decided - g.t_back:.3f}, wait for a step boundary {g.t_switch - g.t_decided:.3f}, "
                  f"restore {g.t_started - g.t_switch:.3f}, first step {g.t_first_commit - g.t_started:.3f})")

    # ----- slow devices ----------------------------------------------------------------------------

    def _judge_speeds(self, c: CommitStep) -> None:
        """A steady step's pace of every trainer (and the idle members' self-tests): a device found slow, or back,
        is decided on (:meth:`_consider_reshape`)."""
        if self.stragglers is None:
            return
        pace = {d: busy / self.work[d] for d, busy in c.busy if self.work.get(d, 0.0) > 0 and busy > 0}
        seen = self.stragglers.slowdowns(pace, self.roles) | self.self_timed
        self.self_timed = {}
        if self.stragglers.observe(seen):
            self.reshape_due = True
            slow = self.stragglers.slow
            self._record(event="slow", step=c.step, slow={str(d): f for d, f in sorted(slow.items())},
                         time=self.clock.wall())
            self._say(f"chameleon: after step {c.step}, slow devices: "
                      + (", ".join(f"{d} (×{f:.2f} its peers' time)" for d, f in sorted(slow.items())) or
                         "none (all back to speed)"))

    def _consider_reshape(self) -> None:
        """A changed verdict on slow devices: decide in the planner's thread how to train around them (Eq. 8)."""
        if (not self.reshape_due or self.reshaping.busy or self.stopping or not self.ledger.started
                or self.ledger.finished or self.pending is not None or self.growing is not None
                or self.ledger.next_step < self.reshape_after or len(self.resident_times) < 1):
            return
        self.reshape_due = False
        speeds = dict(self.stragglers.slow)
        recent = sorted(self.resident_times[-self.ft.slow_window:])
        self.reshaping.submit(
            self.resident, tuple(sorted(speeds.items())), self.coordinator.reshape, self.resident,
            alive=set(self.membership.members), speeds=speeds, step_s=recent[len(recent) // 2],
            horizon_s=self.ft.slow_expected_s, fault_times=list(self.fault_times),
            elapsed_s=self.clock.wall() - self.t0, saved=self.saved, now=self.clock.wall(),
        )
        self.reshaped = Reshape(speeds, self.ledger.next_step, self.clock.wall())

    def _ripe_reshape(self) -> Transition | None:
        """A decided reshape that moves to a new plan, if it is ready and still stands (same plan, same verdict)."""
        search = self.reshaping.finished()
        if search is None:
            return None
        timeline = self.reshaped
        if not search.stands(self.resident) or search.about != tuple(sorted(self.stragglers.slow.items())):
            self.reshaped, self.reshape_due = None, True
            return None
        outcome: Transition | Decision = search.future.result()
        timeline.t_decided = self.clock.wall()
        decision = outcome if isinstance(outcome, Decision) else outcome.decision
        timeline.decision = decision
        self._record(event="reshape", step=timeline.step, slow={str(d): f for d, f in sorted(timeline.speeds.items())},
                     decision=decision.to_dict(), time=timeline.t_decided)
        if isinstance(outcome, Decision):
            self.reshaped = None
            self.reshapes.append(timeline)
            self._say(f"chameleon: {decision.note}: tolerating them pays best\n{decision.table()}")
            return None
        timeline.plan, timeline.estimated_step_s = outcome.plan.describe(), outcome.estimated_step_s
        return outcome

    def _switch_reshape(self, to: Transition) -> int:
        """Publish the generation chosen for slow devices; no new decision on them before it paid its transition."""
        self.reshaped.t_switch = self.clock.wall()
        chosen = to.decision.chosen
        self.reshape_after = self.ledger.next_step + max(self.ft.slow_window,
                                                         math.ceil(chosen.transition / max(chosen.t_step, 1e-9)))
        self._say(f"chameleon: {to.decision.note}: {to.decision.choice}\n{to.decision.table()}\n"
                  f"new plan:\n{to.plan.summary(self.resident)}")
        self._publish(to.plan, members=to.members, resume_step=self.ledger.next_step, manifest=to.manifest)
        return self.generation

    def _close_reshape(self, now: float, step_s: float) -> None:
        r, self.reshaped = self.reshaped, None
        r.t_first_commit, r.first_step_s = now, step_s
        self.reshapes.append(r)
        self.spans.append(("restore", r.t_switch, r.t_started))
        self._record(event="reshaped", generation=self.generation, time=now, **r.record())

    def close(self) -> None:
        """Cancel background planning and a recovery's decision (the end supersedes them)."""
        for background in (self.precomputed, self.growth, self.reshaping, self.deciding):
            background.cancel()


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
