"""A worker process: one device, its role in the current generation's plan, training step by step.

Each generation starts from a :class:`GenerationSpec` the controller publishes in
the store: the plan, its members (devices, in rank order), the step to resume at,
and how state reaches its new layout (a re-layout manifest executed from surviving
replicas, or a checkpoint). A step is a transaction — forward/backward → gradient
sync → *commit* (set by the controller once every worker synced) → optimizer
step — so a fault before the commit discards the step everywhere, and it is redone
with the same samples. The commit carries the controller's order for after the step:
go on, save a checkpoint, stop, or move to a grown generation.

On a peer's fault the worker abandons the generation (its groups are never reused),
keeps its last committed state, and waits for the next spec. Any other error is
reported to the controller with its traceback, and the process exits. The worker
talks to its node agent over a pipe, shows where it is on a shared-memory beacon,
and exits by itself, with one line, when its agent or the controller is gone.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from chameleon.config import model_config
from chameleon.data.stream import SampleStream
from chameleon.layout.geometry import geometry_of, sync_rounds, writers
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import Manifest
from chameleon.layout.schedule import step_actions
from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of
from chameleon.runtime.beacon import Beacon
from chameleon.runtime.checkpoint import CheckpointWriter, checkpoint_root, latest_checkpoint, load_regions
from chameleon.runtime.comm import ABANDONED, BACKENDS, Generation, PeerFailure, connect_store
from chameleon.runtime.device import is_device_fault, prepare_device
from chameleon.runtime.faults import NODE_KINDS, FaultSpec, WorkerFaults, node_firer, typical
from chameleon.runtime.errors import ControllerLost
from chameleon.runtime.messages import CheckpointSaved, Done, Dying, Failed, FinalShards, Left, Ready, Standby, Synced
from chameleon.runtime.schedule import run_step
from chameleon.runtime.stage import StageState, role_of, stage_regions
from chameleon.runtime.transfer import execute_manifest

HEARTBEAT_S = 0.1
POLL_S = 0.0005
IDLE_POLL_S = 0.02  # a member without a stage has no step to start: it polls the store less, leaving the cores to trainers
LIVENESS_CHECK_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs at start; picklable for the forkserver start method."""

    device: int
    store_host: str
    store_port: int
    config: dict
    run_dir: str
    node_addr: str | None
    nproc_per_node: int
    faults: tuple[FaultSpec, ...]
    agent_pid: int


@dataclass(frozen=True)
class GenerationSpec:
    """One generation, as the controller publishes it under :func:`spec_key`."""

    generation: int
    plan: Plan
    devices: tuple[int, ...]
    resume_step: int
    manifest: Manifest | None = None
    checkpoint: str | None = None


@dataclass(frozen=True)
class CommitOrder:
    """What workers do after a committed step: save a checkpoint, then go on, stop, or switch generation."""

    save: bool = False
    stop: bool = False
    switch_to: int | None = None


def spec_key(generation: int) -> str:
    return f"gen{generation}/spec"


def start_key(generation: int) -> str:
    return f"gen{generation}/start"


def commit_key(generation: int, step: int) -> str:
    return f"gen{generation}/commit/{step}"


def node_dying_key(node: int) -> str:
    """Where a worker leaves word before it takes its whole node down (the node's agent dies with it)."""
    return f"dying/node{node}"


STORE_GONE = "the controller is gone (its store closed the connection)"
LATEST_KEY = "latest_generation"
END_KEY = "job/end"
ALIVE_KEY = "controller/alive"


class _Uplink:
    """The pipe to this node's agent; a broken pipe means the agent is gone."""

    def __init__(self, conn: Connection, device: int):
        self.conn, self.device = conn, device
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            with self._lock:
                self.conn.send_bytes(data)
        except OSError:
            _quit(self.device, "its node agent is gone")


def worker_main(spec: WorkerSpec, conn: Connection, lifeline: Connection, beacon_words) -> None:
    """Process entry point: train through faults, report, exit; an error is reported first.

    Ctrl-C and SIGTERM reach a whole process group (a terminal, Slurm): the controller
    decides what they mean, so the worker ignores them.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    uplink, beacon = _Uplink(conn, spec.device), Beacon(beacon_words)
    threading.Thread(target=_heartbeat, args=(beacon, lifeline, spec.device), name="heartbeat", daemon=True).start()
    try:
        _run(spec, uplink, beacon)
    except ControllerLost as err:
        _quit(spec.device, str(err))
    except BaseException as err:  # noqa: BLE001 - everything is reported, then the process dies
        uplink.send(Failed(spec.device, beacon.position().generation, f"{type(err).__name__}: {err}",
                           traceback.format_exc(), beacon.position(), device_fault=is_device_fault(err)))
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


class _Controller:
    """The worker's view of the controller's store: specs, start and commit keys, and its liveness."""

    def __init__(self, store, *, timeout_s: float):
        self.store, self.timeout_s = store, timeout_s
        self._alive, self._alive_seen, self._checked = b"", time.monotonic(), 0.0

    def check(self, keys: list[str]) -> bool:
        try:
            return self.store.check(keys)
        except RuntimeError as err:
            raise ControllerLost(STORE_GONE) from err

    def get(self, key: str) -> bytes:
        try:
            return self.store.get(key)
        except RuntimeError as err:
            raise ControllerLost(STORE_GONE) from err

    def alive(self) -> None:
        """Raise :class:`ControllerLost` when the controller's liveness key stood still for ``timeout_s``."""
        now = time.monotonic()
        if now - self._checked < LIVENESS_CHECK_S:
            return
        self._checked = now
        value = self.get(ALIVE_KEY) if self.check([ALIVE_KEY]) else b""
        if value != self._alive:
            self._alive, self._alive_seen = value, now
        elif now - self._alive_seen > self.timeout_s:
            raise ControllerLost(f"no word from the controller for {self.timeout_s:.0f} s")

    def await_key(self, key: str, gen: Generation, *, poll_s: float = POLL_S) -> bytes:
        """Wait for ``key``, polling every ``poll_s``; a fault flagged first raises, unless ``key`` was set before it."""
        while not self.check([key]):
            try:
                gen.check()
            except PeerFailure:
                if self.check([key]):  # the controller sets the key before it flags a later fault
                    break
                raise
            self.alive()
            time.sleep(poll_s)
        return self.get(key)

    def next_spec(self, after: int, me: int, *, was_member: bool, standby) -> GenerationSpec | None:
        """The newest spec from generation ``after`` on that includes ``me``.

        None when the job ended, or when ``me`` was a member and has been left out
        (fenced: the controller declared it lost). A device never yet a member
        waits, calling ``standby(generation)`` once.
        """
        announced = False
        while True:
            if self.check([END_KEY]):
                return None
            if self.check([LATEST_KEY]) and (latest := int(self.get(LATEST_KEY))) >= after:
                spec: GenerationSpec = pickle.loads(self.get(spec_key(latest)))
                if me in spec.devices:
                    return spec
                if was_member:
                    return None
                if not announced:
                    standby(latest)
                    announced = True
                after = latest + 1
            self.alive()
            time.sleep(POLL_S * 10 if was_member else IDLE_POLL_S)  # a survivor's restore waits on it; a spare's does not


def _run(spec: WorkerSpec, uplink: _Uplink, beacon: Beacon) -> None:
    cfg, me = spec.config, spec.device
    launcher, train = cfg["launcher"], cfg["train"]
    torch.set_num_threads(launcher["threads_per_worker"])
    device = prepare_device(launcher["device"], local_rank=me % spec.nproc_per_node)
    model = model_config(cfg)
    rendezvous = partial(connect_store, spec.store_host, spec.store_port, timeout_s=launcher["timeout_s"])
    control = _Controller(rendezvous(), timeout_s=launcher["timeout_s"])
    stream = SampleStream.from_config(path=cfg["data"]["path"], seq_len=train["seq_len"], seed=train["seed"])
    def announce(fault: FaultSpec, where) -> None:
        dying = Dying(me, where.generation, fault, time.time(), where)
        if fault.kind in NODE_KINDS:
            control.store.set(node_dying_key(me // spec.nproc_per_node), pickle.dumps(dying))
        uplink.send(dying)

    faults = WorkerFaults(list(spec.faults), device=me, beacon=beacon, node_of=lambda d: d // spec.nproc_per_node,
                          announce=announce, agent_pid=spec.agent_pid)
    confirm_s = 2 * cfg["ft"]["heartbeat_timeout_s"] + 1.0
    state: StageState | None = None
    generation, member, compute_s = 0, False, []
    while True:
        beacon.at("standby")
        gen_spec = control.next_spec(generation, me, was_member=member,
                                     standby=lambda g: uplink.send(Standby(me, g)))
        if gen_spec is None:
            break
        generation, member, resume = gen_spec.generation, True, gen_spec.resume_step
        node = [d for d in gen_spec.devices if d // spec.nproc_per_node == me // spec.nproc_per_node]
        faults.enter(generation, resume_step=resume, firer=node_firer(set(gen_spec.plan.devices), node) == me)
        gen = None
        try:
            faults.phase("rebuild", step=resume)
            gen = Generation(
                control.store, connect_store=rendezvous, generation=generation, devices=gen_spec.devices, me=me,
                backend=launcher["backend"] or BACKENDS[launcher["device"]], timeout_s=launcher["timeout_s"], groups=_group_sets(model, gen_spec.plan),
                host=spec.node_addr, confirm_s=confirm_s, beacon=beacon,
                on_connect=partial(faults.phase, "rebuild", step=resume, detail=1),
            )
            established = _establish(gen_spec, state, gen=gen, model=model, cfg=cfg, device=device, faults=faults)
            faults.phase("ready", step=resume)
            uplink.send(Ready(me, generation))
            control.await_key(start_key(generation), gen)
            state = established
            order = _train(gen_spec, state, gen=gen, model=model, cfg=cfg, stream=stream, uplink=uplink,
                           faults=faults, control=control, compute_s=compute_s, run_dir=spec.run_dir)
        except PeerFailure as err:
            if state is not None:
                state.discard_gradients()
            if gen is not None:
                gen.abandon()
            uplink.send(Left(me, generation, str(err)))
            generation += 1
            continue
        ABANDONED.append(gen)  # left in good order, but never torn down: peers may still hold it
        if order is not None and order.switch_to is not None:
            generation = order.switch_to
            continue
        if order is None and state is not None and cfg["output"]["save_params"]:
            written = writers(spec_of(model).layout(model, gen_spec.plan)).get(me, {})
            mine = {n: shard for n, shard in state.shards().items() if n in written}
            uplink.send(FinalShards(me, generation, mine))
        break
    beacon.at("done")
    uplink.send(Done(me, generation))


def _group_sets(model: ModelConfig, plan: Plan) -> list[tuple[int, ...]]:
    """Every sync and TP group of ``plan``, in one order all devices share."""
    layout = spec_of(model).layout(model, plan)
    sets = [g.devices for groups in sync_rounds(geometry_of(plan), layout) for g in groups]
    sets += [st.devices for pipe in plan.pipelines for st in pipe.stages if st.tp > 1]
    sets.append(tuple(sorted(plan.devices)))  # the global gradient norm's all-reduce
    return sets


def _establish(
    gen_spec: GenerationSpec, state: StageState | None, *, gen: Generation, model, cfg, device, faults: WorkerFaults
) -> StageState | None:
    """This device's state in the generation's layout: fresh, re-laid-out from replicas, or from a checkpoint.

    The old state is left untouched, so an abandoned recovery falls back to it.
    """
    train, resume = cfg["train"], gen_spec.resume_step
    role = role_of(gen_spec.plan, gen.me)
    if gen_spec.manifest is not None:
        held = state.tensors() if state is not None else {k: {} for k in ("param", "exp_avg", "exp_avg_sq")}
        moved = execute_manifest(gen_spec.manifest, me=gen.me, state=held, links=gen, device=device, stamp=gen.generation,
                                 on_round=lambda r: faults.phase("transfer", step=resume, detail=r))
        faults.transfer_done(resume)
        if role is None:
            return None
        regions = stage_regions(model, role, spec_of(model).param_shapes(model))
        return StageState(moved, regions, train=train, device=device)
    if role is None:
        return None
    if gen_spec.checkpoint is not None:
        faults.phase("transfer", step=resume)
        regions = stage_regions(model, role, spec_of(model).param_shapes(model))
        info = latest_checkpoint(Path(gen_spec.checkpoint))
        loaded = gen.call(partial(load_regions, info, regions), peer_errors=False)
        return StageState(loaded, regions, train=train, device=device)
    return StageState.create(model, role, seed=train["seed"], train=train, device=device)


def _train(gen_spec: GenerationSpec, state: StageState | None, *, gen: Generation, model, cfg, stream, uplink,
           faults: WorkerFaults, control: _Controller, compute_s: list[float], run_dir: str) -> CommitOrder | None:
    """Train from the resume step; return the order that ended the generation early, None at the last step.

    A fault raises :class:`PeerFailure`. Devices without a stage wait for the order that ends the generation.
    """
    train, plan, me = cfg["train"], gen_spec.plan, gen.me
    if state is None:
        return _idle(gen_spec, gen=gen, control=control, steps=train["steps"], faults=faults)
    role = role_of(plan, me)
    layout = spec_of(model).layout(model, plan)
    rounds = sync_rounds(geometry_of(plan), layout)
    tp = spec_of(model).tp_ops(partial(gen.all_reduce, members=role.spec.devices)) if role.spec.tp > 1 else None
    actions = step_actions(plan)[me]
    saver = _Saver(cfg, layout, gen=gen, uplink=uplink, run_dir=run_dir)
    norm_regions = writers(layout).get(me, {})
    for step in range(gen_spec.resume_step, train["steps"]):
        faults.step_started(step, typical(compute_s, 0.05))
        start = time.perf_counter()
        try:
            result = run_step(
                step, plan=plan, actions=actions, state=state, stream=stream, gen=gen, model=model, train=train,
                rounds=rounds, tp=tp, norm_regions=norm_regions, on_phase=faults.phase,
            )
            compute_s.append(time.perf_counter() - start)
            faults.step_synced()
            uplink.send(Synced(me, gen.generation, step, result.loss_sum, tuple(result.sample_ids), compute_s[-1],
                               result.grad_norm))
            faults.phase("commit", step=step)
            order: CommitOrder = pickle.loads(control.await_key(commit_key(gen.generation, step), gen))
        except PeerFailure:
            state.discard_gradients()
            raise
        faults.phase("optimizer", step=step)
        state.optimizer_step(step, grad_norm=result.grad_norm)
        saver.after_step(step + 1, state, force=order.save)
        if order.stop or order.switch_to is not None:
            saver.finish()
            return order
    saver.finish()
    return None


def _idle(gen_spec: GenerationSpec, *, gen: Generation, control: _Controller, steps: int,
          faults: WorkerFaults) -> CommitOrder | None:
    """A member without a stage: follow the commits until one ends the generation, or the last step."""
    for step in range(gen_spec.resume_step, steps):
        faults.idle_step(step)
        order: CommitOrder = pickle.loads(control.await_key(commit_key(gen.generation, step), gen, poll_s=IDLE_POLL_S))
        if order.stop or order.switch_to is not None:
            return order
    return None


class _Saver:
    """Asynchronous checkpoints of the regions this device writes: every ``ckpt.interval`` steps, or on order."""

    def __init__(self, cfg: dict, layout, *, gen: Generation, uplink: _Uplink, run_dir: str):
        self.interval, self.uplink, self.generation = cfg["ckpt"]["interval"], uplink, gen.generation
        self.device = gen.me
        self.regions = writers(layout).get(gen.me, {})
        root = checkpoint_root(cfg["ckpt"], run_dir)
        self.writer = CheckpointWriter(root, device=gen.me, generation=gen.generation) if self.regions else None
        self.in_flight: int | None = None

    def after_step(self, committed_steps: int, state: StageState, *, force: bool) -> None:
        self._report()
        due = force or (self.interval and committed_steps % self.interval == 0)
        if self.writer is not None and due:
            self.writer.wait()
            self._report()
            held = state.tensors()
            shards = {kind: {n: held[kind][n] for n in self.regions} for kind in held}
            self.writer.save_async(committed_steps, shards, regions=self.regions, committed_steps=committed_steps)
            self.in_flight = committed_steps

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.wait()
            self._report()

    def _report(self) -> None:
        if self.in_flight is not None and not self.writer.pending:
            self.writer.wait()
            self.uplink.send(CheckpointSaved(self.device, self.generation, self.in_flight))
            self.in_flight = None
