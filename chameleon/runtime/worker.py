"""A worker process: one device, its role in the current generation's plan, training step by step.

Each generation starts from a :class:`GenerationSpec` the controller publishes in
the store: the plan, the devices in rank order, the step to resume at, and how
state reaches its new layout (a re-layout manifest executed from surviving
replicas, or a checkpoint). A step is a transaction — forward/backward → gradient
sync → *commit* (set by the controller once every worker synced) → optimizer
step — so a fault before the commit discards the step everywhere, and it is redone
with the same samples. On a fault the worker abandons the generation (its groups
are never reused), keeps its last committed state, and waits for the next spec.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from chameleon.config import model_config, world_size
from chameleon.data.stream import SampleStream
from chameleon.layout.colouring import sync_rounds
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import Manifest
from chameleon.layout.spec import layout_of
from chameleon.model.config import ModelConfig
from chameleon.model.llama import MegatronTP, param_shapes, stage_param_names
from chameleon.runtime.checkpoint import CheckpointWriter, checkpoint_root, latest_checkpoint, load_regions, writers
from chameleon.runtime.comm import BACKENDS, Generation, PeerFailure, connect_store
from chameleon.runtime.device import prepare_device
from chameleon.runtime.faults import SelfKill, planned_faults, worker_side
from chameleon.runtime.schedule import run_step, step_actions
from chameleon.runtime.stage import StageState, role_of, stage_regions
from chameleon.runtime.transfer import execute_manifest

HEARTBEAT_S = 0.1
POLL_S = 0.0005


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs at start; picklable for the spawn start method."""

    device: int
    store_host: str
    store_port: int
    config: dict
    run_dir: str


@dataclass(frozen=True)
class GenerationSpec:
    """One generation, as the controller publishes it under :func:`spec_key`."""

    generation: int
    plan: Plan
    devices: tuple[int, ...]
    resume_step: int
    manifest: Manifest | None = None
    checkpoint: str | None = None


def spec_key(generation: int) -> str:
    return f"gen{generation}/spec"


def start_key(generation: int) -> str:
    return f"gen{generation}/start"


def commit_key(generation: int, step: int) -> str:
    return f"gen{generation}/commit/{step}"


LATEST_KEY = "latest_generation"


class _Link:
    """The pipe to the controller, shared by the main and heartbeat threads."""

    def __init__(self, conn: Connection, device: int):
        self.conn, self.device = conn, device
        self._lock = threading.Lock()

    def send(self, kind: str, *payload) -> None:
        with self._lock:
            self.conn.send((kind, self.device, *payload))

    def heartbeat_forever(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            self.send("hb")


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point: train through faults, report, exit; an unexpected error is sent first."""
    link = _Link(conn, spec.device)
    try:
        _run(spec, link)
    except BaseException:  # noqa: BLE001 - everything is reported, then the process dies
        link.send("error", traceback.format_exc())
        conn.close()
        os._exit(1)
    conn.close()
    os._exit(0)  # abandoned generations hold threads blocked on dead peers: never join them


def _run(spec: WorkerSpec, link: _Link) -> None:
    cfg = spec.config
    launcher, train = cfg["launcher"], cfg["train"]
    torch.set_num_threads(launcher["threads_per_worker"])
    device = prepare_device(launcher["device"], local_rank=spec.device)
    model = model_config(cfg)
    rendezvous = partial(connect_store, spec.store_host, spec.store_port, timeout_s=launcher["timeout_s"])
    store = rendezvous()
    stream = SampleStream.from_config(path=cfg["data"]["path"], seq_len=train["seq_len"], seed=train["seed"])
    faults = worker_side(planned_faults(cfg["failure"], world=world_size(launcher)), spec.device)
    inject = SelfKill(faults, announce=partial(link.send, "dying"))
    threading.Thread(target=link.heartbeat_forever, name="heartbeat", daemon=True).start()
    generation, state = 0, None
    while True:
        gen_spec: GenerationSpec = pickle.loads(_wait_key(store, spec_key(generation)))
        if spec.device not in gen_spec.devices:
            break
        if generation > 0:
            inject(gen_spec.resume_step, "recovery")
        gen = None
        try:
            gen = Generation(
                store, connect_store=rendezvous, generation=generation, devices=gen_spec.devices, me=spec.device,
                backend=launcher["backend"] or BACKENDS[launcher["device"]], timeout_s=launcher["timeout_s"], groups=_group_sets(model, gen_spec.plan),
            )
            established = _establish(gen_spec, state, gen=gen, model=model, cfg=cfg, device=device)
            link.send("ready", generation)
            _await(gen, start_key(generation))
            state = established
            _train(gen_spec, state, gen=gen, model=model, cfg=cfg, stream=stream, link=link, inject=inject, run_dir=spec.run_dir)
        except PeerFailure as err:
            if gen is not None:
                gen.abandon()
            link.send("aborted", generation, str(err))
            generation = _next_generation(store, generation)
            continue
        break
    link.send("done")


def _group_sets(model: ModelConfig, plan: Plan) -> list[tuple[int, ...]]:
    """Every sync and TP group of ``plan``, in one order all devices share."""
    layout = layout_of(plan, param_shapes(model), partial(stage_param_names, model))
    sets = [g.devices for groups in sync_rounds(layout) for g in groups]
    sets += [st.devices for pipe in plan.pipelines for st in pipe.stages if st.tp > 1]
    sets.append(tuple(sorted(plan.devices)))  # the global gradient norm's all-reduce
    return sets


def _establish(gen_spec: GenerationSpec, state: StageState | None, *, gen: Generation, model, cfg, device) -> StageState | None:
    """This device's state in the generation's layout: fresh, re-laid-out from replicas, or from a checkpoint.

    The old state is left untouched, so an abandoned recovery falls back to it.
    """
    train = cfg["train"]
    role = role_of(gen_spec.plan, gen.me)
    if gen_spec.manifest is not None:
        held = state.tensors() if state is not None else {k: {} for k in ("param", "exp_avg", "exp_avg_sq")}
        moved = execute_manifest(gen_spec.manifest, me=gen.me, state=held, links=gen, device=device)
        if role is None:
            return None
        regions = stage_regions(model, role, param_shapes(model))
        return StageState(moved, regions, train=train, device=device)
    if role is None:
        return None
    if gen_spec.checkpoint is not None:
        regions = stage_regions(model, role, param_shapes(model))
        info = latest_checkpoint(Path(gen_spec.checkpoint))
        loaded = gen.call(partial(load_regions, info, regions))
        return StageState(loaded, regions, train=train, device=device)
    return StageState.create(model, role, seed=train["seed"], train=train, device=device)


def _train(gen_spec: GenerationSpec, state: StageState | None, *, gen, model, cfg, stream, link, inject, run_dir) -> None:
    """Train from the resume step to the last step; a fault raises :class:`PeerFailure`."""
    if state is None:
        return
    train, plan = cfg["train"], gen_spec.plan
    role = role_of(plan, gen.me)
    layout = layout_of(plan, param_shapes(model), partial(stage_param_names, model))
    rounds = sync_rounds(layout)
    tp = MegatronTP(partial(gen.all_reduce, members=role.spec.devices)) if role.spec.tp > 1 else None
    actions = step_actions(plan)[gen.me]
    saver = _Saver(cfg, layout, gen=gen, link=link, run_dir=run_dir)
    norm_regions = writers(layout).get(gen.me, {})
    for step in range(gen_spec.resume_step, train["steps"]):
        start = time.perf_counter()
        try:
            result = run_step(
                step, plan=plan, actions=actions, state=state, stream=stream, gen=gen, model=model, train=train,
                rounds=rounds, tp=tp, norm_regions=norm_regions, on_phase=inject,
            )
        except PeerFailure:
            state.discard_gradients()
            raise
        link.send("synced", gen.generation, step, result.loss_sum, result.sample_ids, time.perf_counter() - start, result.grad_norm)
        try:
            _await(gen, commit_key(gen.generation, step))
        except PeerFailure:
            state.discard_gradients()
            raise
        inject(step, "optimizer")
        state.optimizer_step(step, grad_norm=result.grad_norm)
        saver.after_step(step + 1, state)
    saver.finish()
    if cfg["output"]["save_params"]:
        mine = {n: shard for n, shard in state.shards().items() if gen.me in layout[n].holders[0].devices}
        params_dir = Path(run_dir) / ".params"
        params_dir.mkdir(parents=True, exist_ok=True)
        torch.save(mine, params_dir / f"device{gen.me}.pt")


class _Saver:
    """Periodic asynchronous checkpoints of the regions this device writes (``ckpt.interval``)."""

    def __init__(self, cfg: dict, layout, *, gen: Generation, link: _Link, run_dir: str):
        self.interval, self.link, self.generation = cfg["ckpt"]["interval"], link, gen.generation
        self.regions = writers(layout).get(gen.me, {}) if self.interval else {}
        self.writer = CheckpointWriter(checkpoint_root(cfg["ckpt"], run_dir), device=gen.me) if self.regions else None
        self.in_flight: int | None = None

    def after_step(self, committed_steps: int, state: StageState) -> None:
        self._report()
        if self.writer is not None and committed_steps % self.interval == 0:
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
            self.link.send("ckpt_saved", self.generation, self.in_flight)
            self.in_flight = None


def _await(gen: Generation, key: str) -> None:
    """Wait for the controller to set ``key``; a fault flagged first raises, unless ``key`` was set before it."""
    while not gen.store.check([key]):
        try:
            gen.check()
        except PeerFailure:
            if gen.store.check([key]):  # the controller sets the key before it flags a later fault
                return
            raise
        time.sleep(POLL_S)


def _wait_key(store, key: str) -> bytes:
    while not store.check([key]):
        time.sleep(POLL_S)
    return store.get(key)


def _next_generation(store, generation: int) -> int:
    """The newest generation the controller published after ``generation``."""
    while True:
        if store.check([LATEST_KEY]):
            latest = int(store.get(LATEST_KEY))
            if latest > generation:
                return latest
        time.sleep(POLL_S)
