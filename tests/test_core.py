"""The controller's protocol core without a process: events in, effects out, on a fake clock.

A job of two nodes × two devices (dp2 × pp2: pipeline 0 on node 0, pipeline 1 on node 1)
is driven through registration, a generation's start, commits, a lost node, a node fault
announced before it strikes, the progress watchdog, a SIGTERM, checkpoints, a growth, and
recoveries decided in a thread the test runs by hand.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from chameleon.config import CONF_DIR, build_plan, register_configs, tags_honoured, to_config
from chameleon.decision.coordinator import Transition
from chameleon.decision.profiler import load_profile
from chameleon.faults.spec import FaultSpec
from chameleon.layout.relayout import relayout_held
from chameleon.runtime.control.core import Core
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
    Registered,
    SaveCheckpoint,
    Send,
    Tick,
)
from chameleon.runtime.control.notices import (
    CheckpointDamaged,
    ConnectionRefused,
    Disagreed,
    GrowingBack,
    NotFinite,
    NotFiniteAgain,
    Preempting,
    RecoveryDecided,
    ReplayedFinite,
    SlowDevices,
)
from chameleon.runtime.control.recorder import text_of
from chameleon.runtime.node.preflight import check_job
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.errors import LaunchError, TrainingError
from chameleon.runtime.protocol.messages import (
    Begin,
    Commit,
    Done,
    Dying,
    Exited,
    Flag,
    Hello,
    Lease,
    Moves,
    NodeReady,
    NodeSaved,
    NodeSynced,
    Noted,
    Positions,
    Probe,
    Publish,
    Renew,
    Signal,
    Standby,
    Start,
    Welcome,
    parcel,
)
from chameleon.runtime.protocol.position import Position

B = 8


class ByHand(Executor):
    """The decision thread, run by hand: work waits queued until the test has the thread take it up (under way, it
    can no longer be cancelled) or run everything queued to its end."""

    def __init__(self):
        self.jobs: list[tuple[Future, object, tuple, dict]] = []

    def submit(self, fn, /, *args, **kwargs):
        future = Future()
        self.jobs.append((future, fn, args, kwargs))
        return future

    def start(self) -> Future:
        """The thread takes up the first job queued."""
        future = self.jobs[0][0]
        assert future.set_running_or_notify_cancel()
        return future

    def run(self) -> None:
        """The thread runs every job queued, in order; a cancelled one never runs."""
        jobs, self.jobs = self.jobs, []
        for future, fn, args, kwargs in jobs:
            if future.running() or future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except Exception as err:  # noqa: BLE001 - the future carries it, as a thread pool's does
                    future.set_exception(err)


class Inline(ByHand):
    """Background planning and decisions, run at once (the core only ever polls their futures)."""

    def submit(self, fn, /, *args, **kwargs):
        future = super().submit(fn, *args, **kwargs)
        self.run()
        return future


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def wall(self) -> float:
        return self.now

    def mono(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def config(*overrides: str):
    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[
            "launcher.nnodes=2", "launcher.node_rank=0", "launcher.master_addr=127.0.0.1", "launcher.master_port=29999",
            "launcher.nproc_per_node=2", "parallel.dp=2", "parallel.pp=2", f"train.global_batch={B}",
            "train.micro_batch=2", "train.steps=6", "model.n_layers=4", "model.dim=64", "cluster=a100_32",
            "failure=none", "ft.heartbeat_timeout_s=1.0", *overrides])
    check_job(cfg)
    return to_config(cfg), build_plan(cfg)


class Driven(Core):
    """The core as the controller drives it (``controller.py``: ``_select``): each event a pass of its own, then
    :class:`Idle`; :meth:`in_one_pass` hands it several events read in the same pass."""

    def handle(self, event: object) -> list[object]:
        return self.in_one_pass(event)

    def in_one_pass(self, *events: object) -> list[object]:
        """The effects of ``events`` and the Idle after them (on a raise, all the pass emitted is in :attr:`out`)."""
        out = []
        try:
            for event in (*events, Idle()):
                out += super().handle(event)
        except BaseException:
            self.out = out + self.out
            raise
        return out


def core_of(*overrides: str, clock: FakeClock | None = None, faults=(), decider: Executor | None = None,
            planner: Executor | None = None) -> Driven:
    cfg, plan = config(*overrides)
    profile = load_profile(cfg.model, cfg.cluster, micro_batch=2, seq_len=cfg.train.seq_len, tp=1)
    return Driven(cfg, plan=plan, profile=profile, run_dir="/run", store_port=1234, ckpt_root=Path("/run/ckpt"),
                saved=None, faults=list(faults), fired=[], planner=planner or Inline(), decider=decider or Inline(),
                clock=clock or FakeClock())


def hello(core: Core, node: int, **kw) -> Hello:
    per = core.per_node
    return Hello(node, tuple(range(node * per, (node + 1) * per)), 100 + node, f"127.0.0.{node + 1}", "host",
                 core.config, **kw)


def of(effects, kind):
    return [e for e in effects if isinstance(e, kind)]


def sent(effects, kind):
    """Messages of ``kind`` in Send or Broadcast effects."""
    return [e.message for e in effects if isinstance(e, (Send, Broadcast)) and isinstance(e.message, kind)]


def wait(core: Core, clock: FakeClock, seconds: float) -> None:
    """Let ``seconds`` pass with both nodes renewing their leases."""
    for _ in range(int(seconds / 0.5)):
        clock.advance(0.5)
        for node in (0, 1):
            core.handle(Received(node, Lease(node, core.generation)))


def registered(core: Core) -> list:
    out = core.handle(Registered(hello(core, 0)))
    assert out[0] == Admit(0, None) and not sent(out, Publish), "generation 0 waits for every node"
    return out + core.handle(Registered(hello(core, 1)))


def started(core: Core) -> Core:
    registered(core)
    for node in (0, 1):
        core.handle(Received(node, NodeReady(node, 0, (2 * node, 2 * node + 1))))
    return core


def step(core: Core, k: int, *, nodes=(0, 1), norm=(1.0, 3.0), corrupt=((), ())) -> list:
    """Nodes report step ``k``, each the samples of its share of the plan's pipelines (``corrupt``: per node, its
    devices that were not finite)."""
    out, share = [], B // len(nodes)
    for i, node in enumerate(nodes):
        devices = tuple(sorted(d for d in core.spec.plan.devices if d // 2 == node))
        lo = k * B + share * i
        out += core.handle(Received(node, NodeSynced(node, core.generation, k, devices, 0.5, ((lo, lo + share),), 0.1,
                                                     norm[i], core.clock.now, corrupt[i])))
    return out


def test_generation_zero_starts_once_every_node_registered_and_every_member_is_ready():
    core = core_of()
    out = registered(core)
    (welcome,) = [e for e in of(out, Admit) if e.node == 1]
    assert isinstance(welcome.welcome, Welcome) and welcome.welcome.store_port == 1234
    (publish,) = sent(out, Publish)
    assert publish.spec.generation == 0 and publish.spec.devices == (0, 1, 2, 3) and not publish.spec.moves
    assert [m.devices for m in sent(out, Start)] == [(0, 1), (2, 3)]
    assert core.handle(Received(0, NodeReady(0, 0, (0, 1)))) == []
    out = core.handle(Received(1, NodeReady(1, 0, (2, 3))))
    assert sent(out, Begin) == [Begin(0)]


def test_a_step_commits_once_per_node_with_the_whole_plans_gradient_norm():
    core = started(core_of())
    assert core.handle(Received(0, NodeSynced(0, 0, 0, (0, 1), 0.5, ((0, 4),), 0.1, 1.0, core.clock.now))) == []
    out = core.handle(Received(1, NodeSynced(1, 0, 0, (2, 3), 0.25, ((4, 8),), 0.1, 3.0, core.clock.now)))
    (commit,) = sent(out, Commit)
    assert (commit.generation, commit.step) == (0, 0) and commit.grad_norm == pytest.approx(2.0)
    (committed,) = of(out, Committed)
    assert committed.loss == pytest.approx(0.75) and committed.samples == (0, B)


def test_a_lost_node_flags_the_generation_then_publishes_the_next_with_each_nodes_moves():
    core = started(core_of("policy.name=dynamic"))
    step(core, 0)
    core.handle(Received(0, Lease(0, 0)))
    out = core.handle(Lost(1, "its agent's link closed"))
    kinds = [type(e).__name__ if not isinstance(e, (Send, Broadcast)) else type(e.message).__name__ for e in out]
    assert kinds.index("Flag") < kinds.index("Publish"), "survivors abandon the step before the next generation"
    assert Close(1) in out
    (publish,) = sent(out, Publish)
    assert publish.spec.generation == 1 and set(publish.spec.devices) == {0, 1} and publish.spec.resume_step == 1
    moves = [e for e in out if isinstance(e, Send) and isinstance(e.message, Moves)]
    assert [m.node for m in moves] == [0] and publish.spec.moves == (publish.spec.plan != core.first_plan)
    assert all(codec.decode(m.payload) == m.message for m in moves), "encoded in the decision's thread, once"
    (fault,) = [e.event for e in of(out, Record) if e.event["event"] == "fault"]
    assert fault["failed_ranks"] == [2, 3] and "node 1 lost" in fault["cause"]
    (told,) = of(out, RecoveryDecided)
    assert (told.devices, told.step, told.cause, told.plan, told.was) == ((2, 3), 1, fault["cause"], publish.spec.plan,
                                                                          core.first_plan)
    assert told.reload_step is None, "the survivors hold the state: no checkpoint is reloaded"
    assert kinds.index("Publish") < kinds.index("RecoveryDecided") and kinds.index("Moves") < kinds.index("Record"), \
        "the next generation goes out first; the decision's record and notice after it"
    assert core.handle(Received(1, NodeSynced(1, 0, 1, (2, 3), 0, ((0, 1),), 0, None, 0))) == [], "a lost node is deaf"


def test_a_commit_is_pushed_before_a_later_fault_is_flagged():
    core = started(core_of())
    out = step(core, 0)
    out += core.handle(Received(0, Exited(1, 0, -9, Position(0, 1, "forward"), core.clock.now, "last heartbeat")))
    pushed = [type(e.message).__name__ for e in out if isinstance(e, Broadcast)]
    assert pushed.index("Commit") < pushed.index("Flag")
    assert Send(0, Signal(0, 1, 9, "fenced")) in out


def test_a_lease_lapses_into_a_lost_node_and_a_lease_is_answered():
    clock = FakeClock()
    core = started(core_of(clock=clock))
    assert core.handle(Received(1, Lease(1, 0))) == [Send(1, Renew(0))]
    clock.advance(0.9)
    assert not sent(core.handle(Tick()), Flag)
    clock.advance(0.2)
    out = core.handle(Tick())
    assert sent(out, Flag) == [Flag(0)] and "missed its lease" in [e.event for e in of(out, Record)][0]["cause"]


def test_a_node_taken_on_while_the_job_starts_is_leased_from_when_it_is_next_heard():
    """Found at 8,192 devices: nodes busy starting their workers were lost at step 0 for a lease that began at
    their registration. A lease now begins when a node is first heard from after the job took it on; one never
    heard from is lost after launcher.join_timeout_s."""
    clock = FakeClock()
    core = core_of("launcher.join_timeout_s=30", clock=clock)
    core.handle(Registered(hello(core, 1)))
    clock.advance(5.0)  # node 1 registered long before node 0 (its lease would have lapsed at 1 s)
    registered_out = core.handle(Registered(hello(core, 0)))
    assert sent(registered_out, Publish)
    clock.advance(10.0)  # the nodes start their workers, saying nothing for ten lease periods
    assert not sent(core.handle(Tick()), Flag) and 1 in core.nodes
    core.handle(Received(1, NodeReady(1, 0, (2, 3))))  # first heard: the lease runs from here
    clock.advance(0.9)
    assert not sent(core.handle(Tick()), Flag)
    clock.advance(0.2)
    assert sent(core.handle(Tick()), Flag) == [Flag(0)], "once heard from, a node keeps its lease"


def test_a_node_never_heard_from_after_the_job_started_is_lost_after_the_join_timeout():
    clock = FakeClock()
    core = core_of("launcher.join_timeout_s=30", clock=clock)
    registered(core)
    clock.advance(29.9)
    assert not sent(core.handle(Tick()), Flag)
    clock.advance(0.2)
    out = core.handle(Tick())
    assert 1 not in core.nodes and "nothing heard for 30.1 s" in [e.event for e in of(out, Record)][0]["cause"]


def test_a_four_node_loss_at_once_is_decided_from_the_precomputed_plans():
    """ft.fault_domain_nodes=4 plans ahead for losing 1..4 whole nodes: four nodes whose leases lapse in one tick
    are decided with no planner search on the fault path."""
    clock = FakeClock()
    core = core_of("launcher.nnodes=6", "parallel.dp=12", "parallel.pp=1", "train.global_batch=24",
                   "ft.fault_domain_nodes=4", "policy.name=dynamic", clock=clock)
    for node in range(6):
        core.handle(Registered(hello(core, node)))
    for node in range(6):
        core.handle(Received(node, NodeReady(node, 0, (2 * node, 2 * node + 1))))
    planners = (core.planner_, core.planner_.replicated)
    searched = [set(p._searched) for p in planners]
    clock.advance(1.5)
    for node in (0, 5):
        core.handle(Received(node, Lease(node, 0)))
    out = core.handle(Tick())
    (publish,) = sent(out, Publish)[-1:]
    assert set(publish.spec.devices) == {0, 1, 10, 11} and publish.spec.plan.devices
    assert [set(p._searched) for p in planners] == searched, "a loss of up to a rack needs no search"
    faults = [e.event for e in of(out, Record) if e.event["event"] == "fault"]
    assert sorted(d for f in faults for d in f["failed_ranks"]) == list(range(2, 10))


def test_a_lease_is_judged_on_what_the_controller_read_not_on_its_own_stall():
    """Time the controller spent after it last read its links (a long decision, a descheduled process) is no
    node's silence: the tick judges leases as of that reading."""
    clock = FakeClock()
    core = started(core_of(clock=clock))
    core.handle(Received(1, Lease(1, 0)))
    clock.advance(0.5)
    heard_at = clock.mono()
    clock.advance(2.5)  # the controller stalled after reading every link at heard_at
    assert not sent(core.handle(Tick(heard_at=heard_at)), Flag)
    clock.advance(0.1)
    out = core.handle(Tick(heard_at=clock.mono()))  # read again, and node 1 had still said nothing
    assert sent(out, Flag) == [Flag(0)]
    assert "nothing heard for 3.1 s" in [e.event for e in of(out, Record)][0]["cause"]


def killed(core: Core, device: int) -> list:
    """Device ``device``'s worker was SIGKILLed in step 1's forward, as its node reports it."""
    where = Position(core.generation, 1, "forward")
    exited = Exited(device, core.generation, -9, where, core.clock.now, "last heartbeat")
    return core.handle(Received(device // 2, exited))


def test_leases_are_kept_while_a_recovery_is_decided_off_the_loop():
    """Found at 8,192 devices: while the loop decided a loss for minutes, healthy nodes' leases lapsed. The decision
    runs in a thread of its own: leases are renewed meanwhile, the watchdog counts no stall, and the next generation is
    published once the decision is in."""
    clock, decider = FakeClock(), ByHand()
    core = started(core_of("policy.name=dynamic", "ft.stall_timeout_s=2", clock=clock, decider=decider))
    step(core, 0)
    out = killed(core, 1)
    assert sent(out, Flag) == [Flag(0)] and not sent(out, Publish), "decided in its thread, not in the handler"
    for _ in range(10):  # 5 s: five lease periods, over twice the stall bound
        clock.advance(0.5)
        assert core.handle(Received(1, Lease(1, 0))) == [Send(1, Renew(0))]
        assert core.handle(Tick()) == [], "no lease lapsed, no probe, nothing published"
    assert 1 in core.nodes and core.recovery.timeline.failed == [1]
    decider.run()
    out = core.handle(Tick())
    (publish,) = sent(out, Publish)
    assert publish.spec.generation == 1 and set(publish.spec.devices) == {0, 2, 3}
    (fault,) = [e.event for e in of(out, Record) if e.event["event"] == "fault"]
    assert fault["failed_ranks"] == [1] and fault["decide_s"] == pytest.approx(5.0)


def test_a_loss_while_a_recovery_is_decided_supersedes_that_decision():
    """A decision under way knew nothing of a later loss: nothing of it is published, even once it finishes; the one
    decision published is for both losses."""
    clock, decider = FakeClock(), ByHand()
    core = started(core_of("policy.name=dynamic", clock=clock, decider=decider))
    step(core, 0)
    out = killed(core, 1)
    stale = decider.start()  # under way in the thread: too late to cancel
    clock.advance(0.2)
    out += killed(core, 2)
    assert sent(out, Flag) == [Flag(0)], "the broken generation is flagged once"
    decider.run()
    transition, _ = stale.result()
    assert isinstance(transition, Transition) and transition.decision.failed == (1,), "it ran, for device 1"
    out += core.handle(Tick())
    (publish,) = sent(out, Publish)
    assert publish.spec.generation == 1 and set(publish.spec.devices) == {0, 3}
    (fault,) = [e.event for e in of(out, Record) if e.event["event"] == "fault"]
    assert fault["failed_ranks"] == [1, 2] and "; then exit code -9" in fault["cause"]
    assert set(fault["where"]) == {1, 2} and core.recovery.timeline.failed == [1, 2]


def test_losses_read_in_one_pass_are_one_decision():
    """Found at 8,192 devices: a rack's links closed at once were read one after the other, and each loss superseded
    the decision the one before had started (a rack lost at once was decided twice, 2.4 s). The losses the edge
    reads in one pass wait for its Idle: one decision, for them all."""
    decider = ByHand()
    core = started(core_of("policy.name=dynamic", decider=decider))
    step(core, 0)
    where = Position(core.generation, 1, "forward")
    out = core.in_one_pass(*(Received(d // 2, Exited(d, core.generation, -9, where, core.clock.now, "gone"))
                             for d in (1, 2)))
    assert sent(out, Flag) == [Flag(0)]
    (job,) = decider.jobs
    assert not job[0].cancelled(), "one decision submitted, none superseded"
    decider.run()
    out = core.handle(Tick())
    (publish,) = sent(out, Publish)
    assert set(publish.spec.devices) == {0, 3}
    (fault,) = [e.event for e in of(out, Record) if e.event["event"] == "fault"]
    assert fault["failed_ranks"] == [1, 2]


def test_no_recovery_found_in_the_decision_thread_stops_the_run_once_it_is_in():
    """Devices 1 and 3 hold the same layers and no checkpoint exists: the decision for both losses finds no recovery;
    the first loss's decision, still queued, never runs."""
    decider = ByHand()
    core = started(core_of("policy.name=dynamic", decider=decider))
    step(core, 0)
    killed(core, 1)
    (queued, *_), = decider.jobs
    killed(core, 3)
    decider.run()
    assert queued.cancelled()
    with pytest.raises(TrainingError, match=r"no recovery is possible after losing devices \[1, 3\]"):
        core.handle(Tick())
    assert not sent(core.out, Publish)


def test_a_run_is_not_over_while_a_recovery_is_decided_and_closing_cancels_the_decision():
    """Node 1 is lost once node 0's devices stopped on a SIGTERM: the run is not over while its recovery is decided.
    Closing the core cancels the decision (queued, it never runs)."""
    decider = ByHand()
    core = started(core_of("ckpt.interval=0", "policy.name=dynamic", decider=decider))
    core.handle(Preempt())
    step(core, 0)
    for d in (0, 1):
        core.handle(Received(0, Done(d, 0)))
    core.handle(Lost(1, "its agent's link closed"))
    assert not core.over
    (queued, *_), = decider.jobs
    core.close()
    decider.run()
    assert queued.cancelled() and not core.recovery.busy and not sent(core.handle(Tick()), Publish)


def test_a_node_fault_is_noted_before_it_strikes_and_the_recovery_says_where():
    core = started(core_of("policy.name=dynamic"))
    where = Position(0, 1, "backward", 1, -1)
    fault = FaultSpec("node_kill", None, 1, 1, "backward")
    out = core.handle(Received(1, Dying(2, 0, fault, core.clock.now - 0.05, where)))
    assert Send(1, Noted(0, 2)) in out and of(out, Fired)[0].faults == (fault,)
    out = core.handle(Lost(1, "its agent's link closed"))
    (fault_event,) = [e.event for e in of(out, Record) if e.event["event"] == "fault"]
    assert fault_event["where"][2]["phase"] == "backward" and fault_event["t_fault_source"] == "announced"


def test_the_watchdog_asks_where_everyone_is_then_fences_the_stuck_device():
    clock = FakeClock()
    core = started(core_of("ft.stall_timeout_s=5", clock=clock))
    core.handle(Received(0, NodeSynced(0, 0, 0, (0, 1), 0.5, ((0, 4),), 0.1, 1.0, clock.now)))  # node 1 never does
    wait(core, clock, 5.5)
    out = core.handle(Tick())
    (probe,) = sent(out, Probe)
    core.handle(Received(0, Positions(0, probe.probe, {0: (Position(0, 0, "commit"), 5.4), 1: (Position(0, 0, "commit"), 5.4)})))
    out = core.handle(Received(1, Positions(1, probe.probe, {2: (Position(0, 0, "forward", 0, 1), 5.5),
                                                              3: (Position(0, 0, "optimizer"), 5.5)})))
    assert out == [] or not sent(out, Flag)
    out = core.handle(Tick())
    assert Send(1, Signal(0, 3, 9, "fenced")) in out and Send(1, Signal(0, 2, 9, "fenced")) not in out
    assert "stalled" in [e.event for e in of(out, Record) if e.event["event"] == "fault"][0]["cause"]


def test_silence_with_nobody_stuck_stops_the_run_naming_who_waits_on_whom():
    clock = FakeClock()
    core = started(core_of("ft.stall_timeout_s=5", clock=clock))
    wait(core, clock, 6)
    (probe,) = sent(core.handle(Tick()), Probe)
    for node in (0, 1):
        core.handle(Received(node, Positions(node, probe.probe, {
            2 * node: (Position(0, 0, "forward", 0, 2 * node + 1), 6.0),
            2 * node + 1: (Position(0, 0, "backward", 0, 2 * node), 6.0)})))
    with pytest.raises(TrainingError, match="waiting on device"):
        core.handle(Tick())


def test_sigterm_saves_at_the_next_commit_then_stops():
    core = started(core_of("ckpt.interval=0"))
    core.handle(Preempt())
    out = step(core, 0)
    (commit,) = sent(out, Commit)
    assert commit.order.save and commit.order.stop and core.stopping
    assert of(out, Preempting) == [Preempting(0)]
    assert core.spec.writers == (0, 1), "pipeline 0 writes the checkpoint"
    assert of(core.handle(Received(0, NodeSaved(0, 7, 1, (0, 1)))), SaveCheckpoint) == [], "another generation's"
    (save,) = of(core.handle(Received(0, NodeSaved(0, 0, 1, (0, 1)))), SaveCheckpoint)
    assert save.complete.step == 1 and core.saved.committed_steps == 1
    for d in range(4):
        core.handle(Received(d // 2, Done(d, 0)))
    assert core.over


def test_a_second_agent_for_a_running_node_is_refused_and_a_different_config_is_an_error():
    core = started(core_of())
    out = core.handle(Registered(hello(core, 1)))
    assert of(out, Refuse) and "already running" in of(out, Refuse)[0].why
    assert of(out, ConnectionRefused) == [ConnectionRefused(f"node 1 at 127.0.0.2: {of(out, Refuse)[0].why}")]
    core = core_of()
    core.handle(Registered(hello(core, 0)))
    other, _ = config("train.lr=0.1")
    with pytest.raises(LaunchError, match="config differs from node 0's in train.lr"):
        core.handle(Registered(Hello(1, (2, 3), 1, "h", "host", other)))


def test_returning_devices_grow_the_job_at_a_step_boundary():
    clock = FakeClock()
    core = started(core_of("policy.name=dynamic", clock=clock))
    for k in range(3):
        step(core, k)
    core.handle(Lost(1, "gone"))
    g = core.generation
    core.handle(Received(0, NodeReady(0, g, (0, 1))))
    step(core, 3, nodes=(0,), norm=(1.0,))
    out = core.handle(Registered(hello(core, 1, returning=True)))
    assert of(out, Admit) and sent(out, Publish), "the returning node learns the newest generation"
    for d in (2, 3):
        core.handle(Received(1, Standby(d, g)))
    clock.advance(1.0)
    core.handle(Tick())  # decided in the planner's thread (here, at once)
    out = step(core, 4, nodes=(0,), norm=(1.0,))
    (commit,) = sent(out, Commit)
    assert commit.order.switch_to == g + 1
    pushed = [type(e.message).__name__ for e in out if isinstance(e, Broadcast)]
    assert pushed.index("Publish") < pushed.index("Commit"), "the grown generation exists before the switch"
    assert set(core.spec.devices) == {0, 1, 2, 3} and core.spec.resume_step == 5
    (told,) = of(out, GrowingBack)
    assert told.devices == (2, 3) and told.plan is core.spec.plan and told.decision.choice


def test_a_node_back_before_its_loss_is_decided_is_not_told_the_generation_that_still_lists_it():
    """A node returns while the recovery from its loss is still decided: the newest generation lists its devices
    (their workers would rebuild it alone and fail); it learns the recovery's, as every node does, once published."""
    clock, decider = FakeClock(), ByHand()
    core = started(core_of("policy.name=dynamic", clock=clock, decider=decider))
    step(core, 0)
    core.handle(Lost(1, "gone"))
    out = core.handle(Registered(hello(core, 1, returning=True)))
    assert of(out, Admit) and not sent(out, Publish)
    decider.run()
    out = core.handle(Tick())
    (publish,) = sent(out, Publish)
    assert publish.spec.generation == 1 and not publish.spec.device_set & {2, 3} and 1 in core.nodes


def test_a_growth_onto_devices_back_is_decided_from_the_precomputed_plans():
    """Each generation's precompute also searches the shape over every unit with the devices away back: their
    return is decided with no planner search."""
    clock = FakeClock()
    core = started(core_of("policy.name=dynamic", clock=clock))
    step(core, 0)
    core.handle(Lost(1, "gone"))
    g = core.generation
    core.handle(Received(0, NodeReady(0, g, (0, 1))))  # the next generation starts: its precompute runs
    step(core, 1, nodes=(0,), norm=(1.0,))
    planners = (core.planner_, core.planner_.replicated)
    searched = [set(p._searched) for p in planners]
    assert (4, core.resident.n_micro_batches) in searched[0], "the shape with devices 2 and 3 back"
    core.handle(Registered(hello(core, 1, returning=True)))
    for d in (2, 3):
        core.handle(Received(1, Standby(d, g)))
    clock.advance(1.0)
    core.handle(Tick())
    out = step(core, 2, nodes=(0,), norm=(1.0,))
    (told,) = of(out, GrowingBack)
    assert told.devices == (2, 3) and set(core.spec.devices) == {0, 1, 2, 3}
    assert [set(p._searched) for p in planners] == searched, "a growth onto the devices away needs no search"


def test_a_node_back_to_the_plan_it_left_is_decided_while_the_precompute_still_runs():
    """The planner's lane busy (a precompute of thousands of devices takes seconds): devices back to exactly the
    devices of the plan that ran before their loss are decided from that plan (and the options it brings), on the
    decisions' lane, and the job grows back."""
    clock, planner = FakeClock(), ByHand()
    core = started(core_of("policy.name=dynamic", "train.steps=10", clock=clock, planner=planner))
    before = core.resident
    for k in range(5):  # three steady steps measured
        clock.advance(0.5)
        step(core, k)
    core.handle(Lost(1, "gone"))
    g = core.generation
    core.handle(Received(0, NodeReady(0, g, (0, 1))))  # the next generation starts: its precompute is queued
    step(core, 5, nodes=(0,), norm=(1.0,))
    queued = len(planner.jobs)
    core.handle(Registered(hello(core, 1, returning=True)))
    for d in (2, 3):
        core.handle(Received(1, Standby(d, g)))
    clock.advance(1.0)
    core.handle(Tick())
    assert len(planner.jobs) == queued, "nothing more waits on the planner's lane"
    out = step(core, 6, nodes=(0,), norm=(1.0,))
    (told,) = of(out, GrowingBack)
    assert told.devices == (2, 3) and set(core.spec.devices) == set(before.devices) == {0, 1, 2, 3}
    assert all(f.cancelled() or not f.done() for f, *_ in planner.jobs), "decided while the precompute is still queued"


def test_a_growth_onto_the_devices_lost_is_readied_while_they_are_away(monkeypatch):
    """The generation after a loss starts: the growth onto the lost devices is decided ahead (after the precompute,
    on the planner's lane), its manifest built and its moves encoded. Once they are back, the growth chooses the
    same plan and finds both: no manifest is built and nothing encoded again, and every node is sent its part of
    the manifest from the running plan onto the grown one, as a fresh build of it says."""
    import chameleon.decision.coordinator as coordinator
    import chameleon.runtime.control.planning as planning

    built, encoded = [], []
    monkeypatch.setattr(coordinator, "relayout_held", lambda *a, **kw: built.append(1) or relayout_held(*a, **kw))
    monkeypatch.setattr(planning, "parcel", lambda *a, **kw: encoded.append(kw["generation"]) or parcel(*a, **kw))
    clock = FakeClock()
    core = started(core_of("policy.name=dynamic", clock=clock))
    step(core, 0)
    core.handle(Lost(1, "gone"))
    g = core.generation
    encoded.clear()  # the recovery's own moves
    core.handle(Received(0, NodeReady(0, g, (0, 1))))  # generation g starts: the precompute, then the growth ahead
    step(core, 1, nodes=(0,), norm=(1.0,))
    assert encoded == [g + 1], "the growth onto devices 2 and 3 was readied, encoded for the generation after"
    running, readied = core.resident, len(built)
    core.handle(Registered(hello(core, 1, returning=True)))
    for d in (2, 3):
        core.handle(Received(1, Standby(d, g)))
    clock.advance(1.0)
    core.handle(Tick())
    out = step(core, 2, nodes=(0,), norm=(1.0,))
    (told,) = of(out, GrowingBack)
    assert told.devices == (2, 3) and core.generation == g + 1 and set(core.spec.devices) == {0, 1, 2, 3}
    assert (len(built), encoded) == (readied, [g + 1]), "the growth found its manifest and moves built"
    coord = core.coordinator
    fresh = relayout_held(coord.holdings(running), coord.holdings(core.spec.plan), survivors=[0, 1, 2, 3])
    expected = parcel(fresh, generation=g + 1, nodes=range(2), node_of=core.topology.node_of)
    assert {e.node: e.payload for e in out if isinstance(e, Send) and isinstance(e.message, Moves)} == \
        {node: payload for node, (_, payload) in expected.sends.items()}


@pytest.mark.parametrize(("device", "backend", "tagless"), [("cpu", None, False), ("cuda", "gloo", False),
                                                           ("cuda", None, True), ("npu", None, True)])
def test_recovery_plans_pipeline_on_every_backend_and_only_safely_without_tags(device, backend, tagless):
    """NCCL and HCCL ignore tags: re-plans may pipeline there, but the coordinator refuses plans whose traffic would
    mismatch or deadlock without tags (tests/test_rendezvous.py)."""
    cfg, plan = config("parallel.dp=4", "parallel.pp=1")
    cfg.launcher.device, cfg.launcher.backend = device, backend  # as validated on a host with that device
    profile = load_profile(cfg.model, cfg.cluster, micro_batch=2, seq_len=cfg.train.seq_len, tp=1)
    core = Core(cfg, plan=plan, profile=profile, run_dir="/run", store_port=1234, ckpt_root=Path("/run/ckpt"),
                saved=None, faults=[], fired=[], planner=Inline(), decider=Inline(), clock=FakeClock())
    assert core.planner_.lengths == (1, 2, 3, 4)
    assert core.coordinator.tagless == tagless == (not tags_honoured(cfg.launcher))


NAN = float("nan")


def test_a_step_that_is_not_finite_is_replayed_and_a_finite_replay_names_the_device():
    core = started(core_of())
    step(core, 0)
    out = step(core, 1, norm=(NAN, 3.0), corrupt=((1,), ()))
    (commit,) = sent(out, Commit)
    assert commit.step == 1 and commit.order.replay and commit.grad_norm is None
    (told,) = of(out, NotFinite)
    assert (told.step, told.loss, told.corrupt, told.samples) == (1, 1.0, (1,), (8, 16)) and told.grad_norm != told.grad_norm
    assert not of(out, Committed) and core.ledger.next_step == 1, "nothing of the step is committed"
    out = step(core, 1)
    (commit,) = sent(out, Commit)
    assert commit.step == 1 and not commit.order.replay
    assert [c.step for c in of(out, Committed)] == [1]
    (replayed,) = [e.event for e in of(out, Record) if e.event["event"] == "replayed"]
    assert replayed["suspects"] == [1] and not replayed["evicted"]
    assert of(out, ReplayedFinite) == [ReplayedFinite(1, (1,), False)]
    assert not sent(out, Flag), "ft.on_corrupt=replay keeps the device"
    assert [c.step for c in of(step(core, 2), Committed)] == [2]


def test_a_loss_that_is_not_finite_is_replayed_too_and_evict_fences_the_named_device():
    core = started(core_of("ft.on_corrupt=evict", "policy.name=dynamic"))
    out = core.handle(Received(0, NodeSynced(0, 0, 0, (0, 1), float("inf"), ((0, 4),), 0.1, 1.0, 0.0, (0,))))
    out += core.handle(Received(1, NodeSynced(1, 0, 0, (2, 3), 0.5, ((4, 8),), 0.1, 1.0, 0.0)))
    assert sent(out, Commit)[0].order.replay
    out = step(core, 0)
    pushed = [type(e.message).__name__ for e in out if isinstance(e, Broadcast)]
    assert pushed.index("Commit") < pushed.index("Flag"), "the replayed step commits before the device goes"
    assert of(out, ReplayedFinite) == [ReplayedFinite(0, (0,), True)]
    assert Send(0, Signal(0, 0, 9, "fenced")) in out
    (publish,) = sent(out, Publish)
    assert 0 not in publish.spec.devices and publish.spec.resume_step == 1
    (fault,) = [e.event for e in of(out, Record) if e.event["event"] == "fault"]
    assert fault["failed_ranks"] == [0] and "not finite in step 0" in fault["cause"]


def test_a_step_not_finite_again_on_its_replay_stops_the_run_naming_it_and_its_samples():
    core = started(core_of())
    step(core, 0)
    step(core, 1, norm=(NAN, NAN))
    with pytest.raises(TrainingError, match=r"step 1 is not finite again on its replay .* samples \[8, 16\); "
                                            r"nothing after step 0 is committed"):
        step(core, 1, norm=(NAN, NAN))


def test_replicas_that_disagree_keep_the_step_open_and_every_holder_without_a_majority_is_lost():
    """dp2 × pp2: devices 1 and 3 hold the same layers. Their digests differ and neither has a majority, so both are
    lost; with no checkpoint, no survivor holds those layers and the run stops saying so."""
    core = started(core_of("policy.name=dynamic"))
    step(core, 0)
    core.handle(Received(0, NodeSynced(0, 0, 1, (0, 1), 0.5, ((8, 12),), 0.1, 1.0, 0.0, (), ((0, 5), (1, 6)))))
    with pytest.raises(TrainingError, match=r"no recovery is possible after losing devices \[1, 3\]"):
        core.handle(Received(1, NodeSynced(1, 0, 1, (2, 3), 0.5, ((12, 16),), 0.1, 1.0, 0.0, (), ((2, 5), (3, 7)))))
    assert core.ledger.committed == 0, "the step whose state disagreed is not committed"
    (disagreement,) = [e.event for e in of(core.out, Record) if e.event["event"] == "disagreement"]
    assert disagreement["step"] == 1 and disagreement["outvoted"] == [1, 3]
    assert of(core.out, Disagreed) == [Disagreed(1, (1, 3))]
    assert sent(core.out, Flag) == [Flag(0)]


def test_a_step_not_finite_again_on_the_same_devices_alone_evicts_them():
    """A parameter corrupted on device 1 makes every try of the step non-finite there (and on device 0, which
    receives its gradients), not on the other pipeline: the devices are evicted, not the run stopped."""
    core = started(core_of("policy.name=dynamic"))
    step(core, 0)
    step(core, 1, norm=(NAN, 3.0), corrupt=((0, 1), ()))
    out = step(core, 1, norm=(NAN, 3.0), corrupt=((0, 1), ()))
    (fault,) = [e.event for e in of(out, Record) if e.event["event"] == "fault"]
    assert fault["failed_ranks"] == [0, 1] and "not finite in step 1 and its replay" in fault["cause"]
    (told,) = of(out, NotFiniteAgain)
    assert (told.step, told.corrupt) == (1, (0, 1))
    (publish,) = sent(out, Publish)
    assert set(publish.spec.devices) == {2, 3} and publish.spec.resume_step == 1


def test_the_recorder_alone_puts_the_cores_notices_into_the_users_words():
    assert text_of(Disagreed(4, (1, 3))) == (
        "chameleon: replicas disagree before step 4: devices [1, 3] are outvoted by their replicas' digests (with no "
        "majority, every holder is): not committed; they are lost devices")
    assert text_of(NotFinite(3, NAN, None, (1,), (24, 32))) == (
        "chameleon: step 3 is not finite (loss nan, gradient norm None; devices [1] not finite before the sync): not "
        "committed; replaying it (samples [24, 32))")
    assert text_of(ReplayedFinite(3, (1,), False)) == (
        "chameleon: step 3 replayed finite: the fault was transient; devices [1], whose own gradients were not "
        "finite, stay (ft.on_corrupt=replay)")
    assert text_of(ReplayedFinite(3, (), False)) == (
        "chameleon: step 3 replayed finite: the fault was transient; no device's own gradients were not finite")
    assert text_of(CheckpointDamaged(2, "a shard's digest differs", None)) == (
        "chameleon: device 2 found the checkpoint it restores damaged: a shard's digest differs; no older checkpoint "
        "of this run is left")
    assert text_of(SlowDevices(7, {3: 2.5, 1: 1.75})) == (
        "chameleon: after step 7, slow devices: 1 (×1.75 its peers' time), 3 (×2.50 its peers' time)")
    assert text_of(SlowDevices(9, {})) == "chameleon: after step 9, slow devices: none (all back to speed)"
