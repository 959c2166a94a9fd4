"""A worker process: one device, its role in the current generation's plan, training step by step.

Each generation starts from a :class:`~chameleon.runtime.protocol.messages.GenerationSpec`
the controller pushes through the node agent: the plan, its members (devices, in
rank order), the step to resume at, and how state reaches its new layout (a
re-layout manifest executed from surviving replicas, or a checkpoint). A step is
a transaction — forward/backward → gradient sync → *commit* (pushed by the
controller once every trainer synced) → optimizer step — so a fault before the
commit discards the step everywhere, and it is redone with the same samples. The
commit carries the whole plan's gradient norm (the controller summed the
trainers' parts) and the order for after the step: go on, save a checkpoint,
stop, or move to a grown generation.

On a peer's fault the worker abandons the generation (its groups are never reused),
keeps its last committed state, and waits for the next spec. Any other error is
reported with its traceback, and the process exits. The worker talks to its node
agent over two local pipes (reports up, pushed frames down), reads fault flags
from shared memory, shows where it is on a shared-memory beacon, and exits by
itself, with one line, when its agent is gone. It uses the controller's store
only to connect its process groups.
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn

import torch

from chameleon.config import Backend, Config, Device, SlowPolicy
from chameleon.data.stream import Streams, evaluation_due, open_streams
from chameleon.faults.inject import WorkerFaults, typical
from chameleon.faults.spec import FaultSpec, node_firer
from chameleon.layout.geometry import geometry_of, sync_rounds, writers
from chameleon.layout.groups import plan_groups
from chameleon.layout.schedule import step_actions
from chameleon.model.spec import spec_of
from chameleon.runtime.checkpoint import (
    CheckpointWriter,
    DamagedCheckpoint,
    checkpoint_at,
    checkpoint_root,
    load_regions,
)
from chameleon.runtime.node.beacon import Beacon
from chameleon.runtime.node.downlink import Inbox
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.errors import ControllerLost
from chameleon.runtime.protocol.messages import (
    CheckpointSaved,
    Commit,
    CommitOrder,
    Damaged,
    Done,
    Dying,
    Evaluated,
    Failed,
    FinalShards,
    GenerationSpec,
    Ready,
    SelfTimed,
    Standby,
    Synced,
    sample_ranges,
)
from chameleon.runtime.protocol.timeouts import Timeouts
from chameleon.runtime.protocol.topology import Topology
from chameleon.runtime.worker.comm import ABANDONED, Generation, PeerFailure, connect_store, store_ops
from chameleon.runtime.worker.completion import apply_library_policy
from chameleon.runtime.worker.device import allocator_peaks, is_device_fault, prepare_device, self_test
from chameleon.runtime.worker.schedule import evaluate, run_step
from chameleon.runtime.worker.stage import StageState, role_of, stage_regions
from chameleon.runtime.worker.transfer import execute_manifest

HEARTBEAT_S = 0.1
WAIT_S = 0.05  # a wait on the downlink wakes at once when a frame comes; this bounds fault and liveness checks


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs at start; picklable for the forkserver start method."""

    device: int
    store_host: str
    store_port: int
    config: Config
    run_dir: str
    node_addr: str | None
    nproc_per_node: int
    faults: tuple[FaultSpec, ...]
    first_generation: int = 0  # a restarted worker's: generations before it still count it a member


class _Uplink:
    """The pipe to this node's agent; a broken pipe means the agent is gone."""

    def __init__(self, conn: Connection, device: int):
        self.conn, self.device = conn, device
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        try:
            frame = codec.encode(message)
            with self._lock:
                self.conn.send_bytes(frame)
        except OSError:
            _quit(self.device, "its node agent is gone")


def worker_main(spec: WorkerSpec, conn: Connection, down: Connection, lifeline: Connection, beacon_words,
                board_words) -> None:
    """Process entry point: train through faults, report, exit; an error is reported first.

    Ctrl-C and SIGTERM reach a whole process group (a terminal, Slurm): the controller
    decides what they mean, so the worker ignores them.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc.freeze()  # torch's objects, inherited from the forkserver: collections never walk them again
    uplink, beacon = _Uplink(conn, spec.device), Beacon(beacon_words)
    inbox = Inbox(down, board_words, silence_s=spec.config.launcher.timeout_s)
    threading.Thread(target=_heartbeat, args=(beacon, lifeline, spec.device), name="heartbeat", daemon=True).start()
    try:
        _run(spec, uplink, inbox, beacon)
    except ControllerLost as err:
        _quit(spec.device, str(err))
    except BaseException as err:  # noqa: BLE001 - everything is reported, then the process dies
        where = beacon.position()
        uplink.send(Failed(spec.device, where.generation, f"{type(err).__name__}: {err}", traceback.format_exc(),
                           where, device_fault=is_device_fault(err, where.phase)))
        os._exit(1)
    os._exit(0)  # abandoned generations hold threads blocked on dead peers: never join them


def _heartbeat(beacon: Beacon, lifeline: Connection, device: int) -> None:
    """Show the agent this process is scheduled; leave at once if the agent is gone."""
    while True:
        beacon.beat()
        if lifeline.poll():  # only EOF ever arrives: the agent exited
            _quit(device, "its node agent is gone")
        time.sleep(HEARTBEAT_S)


def _quit(device: int, why: str) -> None:
    print(f"chameleon worker {device}: {why}; exiting", file=sys.stderr, flush=True)
    os._exit(1)


class _Pushed:
    """What the controller pushed, as this worker waits for it (a fault flagged first raises)."""

    def __init__(self, inbox: Inbox):
        self.inbox = inbox

    def next_spec(self, after: int, me: int, *, was_member: bool, standby) -> GenerationSpec | None:
        """The newest spec from generation ``after`` on that includes ``me``.

        None when the job ended, or when ``me`` was a member and has been left out
        (fenced: the controller declared it lost). A device never yet a member
        waits, calling ``standby(generation)`` once.
        """
        announced = False
        while True:
            self.inbox.pump(0.0)
            if self.inbox.ended:
                return None
            spec = self.inbox.spec
            if spec is not None and spec.generation >= after:
                if me in spec.devices:
                    self.inbox.forget(spec.generation)
                    return spec
                if was_member:
                    return None
                if not announced:
                    standby(spec.generation)
                    announced = True
                after = spec.generation + 1
            self.inbox.pump(WAIT_S)

    def begun(self, gen: Generation) -> None:
        """Until the generation starts (every member ready)."""
        while gen.generation not in self.inbox.begun:
            gen.check()
            self.inbox.pump(WAIT_S)

    def abandoned(self, gen: Generation) -> NoReturn:
        """Until the controller flags the generation (raises :class:`PeerFailure`)."""
        while True:
            gen.check()
            self.inbox.pump(WAIT_S)

    def commit(self, gen: Generation, step: int) -> Commit:
        """The commit of ``step``; a fault flagged first raises, unless the commit was pushed before the flag."""
        key = (gen.generation, step)
        while key not in self.inbox.commits:
            if gen.flagged():
                self.inbox.pump(0.0)  # everything pushed before the flag is in the pipe by now
                if key in self.inbox.commits:
                    break
                gen.check()
            self.inbox.pump(WAIT_S)
        return self.inbox.commits.pop(key)


def _run(spec: WorkerSpec, uplink: _Uplink, inbox: Inbox, beacon: Beacon) -> None:
    cfg, me = spec.config, spec.device
    launcher, train = cfg.launcher, cfg.train
    torch.set_num_threads(launcher.threads_per_worker)
    backend = launcher.backend or Device(launcher.device).backend
    device = prepare_device(launcher.device, local_rank=me % spec.nproc_per_node, own_device=backend != Backend.gloo)
    apply_library_policy(backend)
    model = cfg.model
    rendezvous = partial(connect_store, spec.store_host, spec.store_port, timeout_s=launcher.timeout_s)
    pushed = _Pushed(inbox)
    streams = open_streams(cfg.data, seq_len=train.seq_len, seed=train.seed)

    def announce(fault: FaultSpec, where) -> None:
        uplink.send(Dying(me, where.generation, fault, time.time(), where))

    topology = Topology(launcher.nnodes, spec.nproc_per_node)
    faults = WorkerFaults(list(spec.faults), device=me, beacon=beacon, node_of=topology.node_of,
                          announce=announce)
    confirm_s = Timeouts.of(cfg).confirm_s
    base_s = self_test(device)  # its speed at start

    def self_timed(generation: int, step: int) -> None:
        if cfg.ft.slow == SlowPolicy.on:
            uplink.send(SelfTimed(me, generation, step, self_test(device, faults.pace) / base_s))

    state: StageState | None = None
    generation, member, compute_s, previous, done = spec.first_generation, False, [], None, False
    while True:
        beacon.at("standby")
        gen_spec = pushed.next_spec(generation, me, was_member=member, standby=lambda g: uplink.send(Standby(me, g)))
        if gen_spec is None:
            break
        generation, member, resume, done = gen_spec.generation, True, gen_spec.resume_step, False
        node = [d for d in gen_spec.devices if topology.node_of(d) == topology.node_of(me)]
        faults.enter(generation, resume_step=resume, firer=node_firer(set(gen_spec.plan.devices), node) == me)
        gen = None
        try:
            faults.phase("rebuild", step=resume)
            gen = Generation(
                connect_store=rendezvous, generation=generation, me=me, backend=backend, timeout_s=launcher.timeout_s,
                groups=plan_groups(gen_spec.plan, spec_of(model).layout(model, gen_spec.plan), gen_spec.manifest),
                flagged=partial(inbox.flagged, generation), host=spec.node_addr,
                confirm_s=confirm_s, beacon=beacon, reuse=previous,
                on_connect=partial(faults.phase, "rebuild", step=resume, detail=1), device=device,
                abort_s=cfg.ft.abort_timeout_s,
            )
            if previous is not None:
                previous.retire(gen)
            previous = None
            try:
                established = _establish(gen_spec, state, gen=gen, model=model, cfg=cfg, device=device, faults=faults)
            except DamagedCheckpoint as err:  # the controller decides again; this generation will never begin
                uplink.send(Damaged(me, generation, resume, str(err)))
                pushed.abandoned(gen)
            faults.phase("ready", step=resume)
            uplink.send(Ready(me, generation))
            pushed.begun(gen)
            state = established
            order = _train(gen_spec, state, gen=gen, model=model, cfg=cfg, streams=streams, uplink=uplink,
                           faults=faults, pushed=pushed, compute_s=compute_s, run_dir=spec.run_dir,
                           self_timed=self_timed)
        except PeerFailure:
            if state is not None:
                state.discard_gradients()
            if gen is not None:
                gen.abandon(before_abort=faults.abort_started)
            if previous is not None:  # its successor broke while connecting: keep it referenced, as a broken one
                ABANDONED.append(previous)
            previous = None
            generation += 1
            continue
        if order is not None and order.switch_to is not None:
            generation, previous = order.switch_to, gen  # every group is quiescent: the next keeps what it can, the
            continue  # rest is retired
        ABANDONED.append(gen)  # the job's end: left in good order, never torn down (peers may still hold it)
        if order is not None:
            break  # a stop was ordered: the job ends
        if state is not None and cfg.output.save_params:
            written = writers(spec_of(model).layout(model, gen_spec.plan)).get(me, {})
            mine = {n: shard for n, shard in state.shards().items() if n in written}
            uplink.send(FinalShards(me, generation, mine))
        beacon.at("done")
        uplink.send(Done(me, generation, store_ops(), _peak_rss(), *allocator_peaks(device)))
        generation, done = generation + 1, True  # wait for the end: a fault now (in a peer's last validation) needs it
    if not done:
        beacon.at("done")
        uplink.send(Done(me, generation, store_ops(), _peak_rss(), *allocator_peaks(device)))


def _peak_rss() -> int:
    """This process's peak resident memory, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _establish(
    gen_spec: GenerationSpec, state: StageState | None, *, gen: Generation, model, cfg: Config, device,
    faults: WorkerFaults,
) -> StageState | None:
    """This device's state in the generation's layout: fresh, re-laid-out from replicas, or from a checkpoint.

    The old state is left untouched, so an abandoned recovery falls back to it.
    """
    train, resume = cfg.train, gen_spec.resume_step
    role = role_of(gen_spec.plan, gen.me)
    if gen_spec.moves:
        if gen_spec.manifest is None:
            raise RuntimeError(f"generation {gen_spec.generation} moves state, but no part of its manifest arrived")
        held = state.tensors() if state is not None else {k: {} for k in ("param", "exp_avg", "exp_avg_sq")}
        moved = execute_manifest(gen_spec.manifest, me=gen.me, state=held, links=gen, device=device, stamp=gen.generation,
                                 on_round=lambda r: faults.phase("transfer", step=resume, detail=r))
        faults.transfer_done(resume)
        if role is None:
            return None
        if gen.me in gen_spec.manifest.kept:
            return state  # the same regions in the new layout: the state stays as it is, uncopied
        regions = stage_regions(model, role, spec_of(model).param_shapes(model))
        return StageState(moved, regions, train=train, device=device)
    if role is None:
        return None
    if gen_spec.checkpoint is not None:
        faults.phase("transfer", step=resume)
        regions = stage_regions(model, role, spec_of(model).param_shapes(model))
        info = checkpoint_at(Path(gen_spec.checkpoint), resume)  # the one the controller chose, by its step
        loaded = gen.call(partial(load_regions, info, regions), peer_errors=False)
        return StageState(loaded, regions, train=train, device=device)
    return StageState.create(model, role, seed=train.seed, train=train, device=device)


def _train(gen_spec: GenerationSpec, state: StageState | None, *, gen: Generation, model, cfg: Config,
           streams: Streams, uplink, faults: WorkerFaults, pushed: _Pushed, compute_s: list[float],
           run_dir: str, self_timed: Callable[[int, int], None]) -> CommitOrder | None:
    """Train from the resume step; return the order that ended the generation early, None at the last step.

    The validation loss is taken before each step it is due at and after the last one
    (unless this job recorded it already). A fault raises :class:`PeerFailure`. Devices
    without a stage follow the commits until one ends the generation, timing their self-test each step.
    """
    train, plan, me = cfg.train, gen_spec.plan, gen.me
    faults.stage = state
    if state is None:
        return _idle(gen_spec, gen=gen, pushed=pushed, steps=train.steps, faults=faults,
                     self_timed=partial(self_timed, gen.generation))
    role = role_of(plan, me)
    layout = spec_of(model).layout(model, plan)
    rounds = sync_rounds(geometry_of(plan), layout)
    tp = spec_of(model).tp_ops(partial(gen.all_reduce, members=role.spec.devices)) if role.spec.tp > 1 else None
    actions = step_actions(plan)[me]
    saver = _Saver(cfg, layout, gen=gen, uplink=uplink, run_dir=run_dir, faults=faults)
    norm_regions = writers(layout).get(me, {})

    def validate(step: int) -> None:
        if (streams.val is not None and step > gen_spec.evaluated
                and evaluation_due(step, interval=train.eval_interval, steps=train.steps)):
            loss = evaluate(step, plan=plan, actions=actions, state=state, stream=streams.val, gen=gen, model=model,
                            train=train, tp=tp, on_phase=faults.phase, pace=faults.pace)
            uplink.send(Evaluated(me, gen.generation, step, loss))

    slots = cfg.ft.digest_interval
    for step in range(gen_spec.resume_step, train.steps):
        validate(step)
        commit = None
        while commit is None or commit.order.replay:  # a step that was not finite is trained again
            if commit is not None:
                state.discard_gradients()
            digest = state.digest(step % slots, slots) if slots else None  # of the state this step trains with
            _adopt_injected(pushed, faults)
            faults.step_started(step, typical(compute_s, 0.05))
            start = time.perf_counter()
            try:
                result = run_step(
                    step, plan=plan, actions=actions, state=state, stream=streams.train, gen=gen, model=model,
                    train=train, rounds=rounds, tp=tp, norm_regions=norm_regions, on_phase=faults.phase,
                    pace=faults.pace,
                )
                compute_s.append(time.perf_counter() - start)
                faults.step_synced()
                uplink.send(Synced(me, gen.generation, step, result.loss_sum, sample_ranges(result.sample_ids),
                                   compute_s[-1], result.norm_sq, result.finite, digest, result.busy_s))
                faults.phase("commit", step=step)
                commit = pushed.commit(gen, step)
            except PeerFailure:
                state.discard_gradients()
                raise
        faults.phase("optimizer", step=step)
        state.optimizer_step(step, grad_norm=commit.grad_norm)
        saver.after_step(step + 1, state, force=commit.order.save)
        if commit.order.stop or commit.order.switch_to is not None:
            saver.finish()
            return commit.order
    saver.finish()
    validate(train.steps)
    return None


def _idle(gen_spec: GenerationSpec, *, gen: Generation, pushed: _Pushed, steps: int,
          faults: WorkerFaults, self_timed: Callable[[int], None]) -> CommitOrder | None:
    """A member without a stage: follow the commits until one ends the generation, or the last step, timing its
    self-test as each step starts (``self_timed(step)``)."""
    for step in range(gen_spec.resume_step, steps):
        _adopt_injected(pushed, faults)
        faults.idle_step(step)
        self_timed(step)
        order = pushed.commit(gen, step).order
        while order.replay:
            order = pushed.commit(gen, step).order
        if order.stop or order.switch_to is not None:
            return order
    return None


def _adopt_injected(pushed: _Pushed, faults: WorkerFaults) -> None:
    """Faults the controller fired at their time and the agent pushed (slowness): paced from this step on."""
    while pushed.inbox.injected:
        faults.injected(pushed.inbox.injected.pop(0))


class _Saver:
    """Asynchronous checkpoints of the regions this device writes: every ``ckpt.interval`` steps, or on order."""

    def __init__(self, cfg: Config, layout, *, gen: Generation, uplink: _Uplink, run_dir: str, faults: WorkerFaults):
        self.interval, self.uplink, self.generation = cfg.ckpt.interval, uplink, gen.generation
        self.device, self.faults = gen.me, faults
        self.regions = writers(layout).get(gen.me, {})
        root = checkpoint_root(cfg.ckpt, run_dir)
        self.writer = CheckpointWriter(root, device=gen.me, generation=gen.generation) if self.regions else None
        self.in_flight: tuple[int, Path] | None = None  # the step and file being written

    def after_step(self, committed_steps: int, state: StageState, *, force: bool) -> None:
        self._report()
        due = force or (self.interval and committed_steps % self.interval == 0)
        if self.writer is not None and due:
            self.writer.wait()
            self._report()
            held = state.tensors()
            shards = {kind: {n: held[kind][n] for n in self.regions} for kind in held}
            path = self.writer.save_async(committed_steps, shards, regions=self.regions, committed_steps=committed_steps)
            self.in_flight = committed_steps, path

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.wait()
            self._report()

    def _report(self) -> None:
        if self.in_flight is not None and not self.writer.pending:
            self.writer.wait()
            step, path = self.in_flight
            self.faults.checkpoint_written(step, path)
            self.uplink.send(CheckpointSaved(self.device, self.generation, step))
            self.in_flight = None
