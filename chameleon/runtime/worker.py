"""A worker process: one device, one role in the current plan, training step by step.

A step is a transaction: forward/backward of this worker's micro-batches → gradient
sync → optimizer step. The worker reports each finished step to the controller over
a pipe (which doubles as its heartbeat) and, at the end, its share of the final
parameters.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from chameleon.config import build_plan, model_config
from chameleon.data.stream import SampleStream
from chameleon.layout.colouring import sync_rounds
from chameleon.layout.plan import Plan
from chameleon.layout.spec import layout_of
from chameleon.model.llama import ProcessGroupTP, param_shapes, stage_param_names
from chameleon.runtime.comm import Generation, connect_store
from chameleon.runtime.device import prepare_device
from chameleon.runtime.schedule import run_step
from chameleon.runtime.stage import Role, StageState, role_of


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs; picklable for the spawn start method."""

    rank: int
    world: int
    store_host: str
    store_port: int
    config: dict
    run_dir: str


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point: train, report, and exit; any error is sent to the controller."""
    try:
        _train(spec, conn)
    except BaseException:  # noqa: BLE001 - everything is reported, then the process dies
        conn.send(("error", spec.rank, traceback.format_exc()))
        conn.close()
        os._exit(1)
    conn.close()


def _create_groups(gen: Generation, plan: Plan, rounds, role: Role) -> ProcessGroupTP | None:
    """Create every sync and TP group on every rank, in one order; return this stage's TP ops."""
    for groups in rounds:
        for sync in groups:
            gen.group(sync.devices)
    tp_meshes = [stage.devices for pipe in plan.pipelines for stage in pipe.stages if stage.tp > 1]
    for devices in tp_meshes:
        gen.group(devices)
    return ProcessGroupTP(gen.group(role.spec.devices)) if role.spec.tp > 1 else None


def _train(spec: WorkerSpec, conn: Connection) -> None:
    cfg = spec.config
    launcher, train = cfg["launcher"], cfg["train"]
    torch.set_num_threads(launcher["threads_per_worker"])
    device = prepare_device(launcher["device"], local_rank=spec.rank)
    model = model_config(cfg)
    plan = build_plan(cfg)
    store = connect_store(spec.store_host, spec.store_port, timeout_s=launcher["timeout_s"])
    gen = Generation(
        store, generation=0, rank=spec.rank, world=spec.world, device=launcher["device"], timeout_s=launcher["timeout_s"]
    )
    role = role_of(plan, spec.rank)
    state = StageState.create(model, role, seed=train["seed"], train=train, device=device)
    layout = layout_of(plan, param_shapes(model), partial(stage_param_names, model))
    rounds = sync_rounds(layout)
    tp = _create_groups(gen, plan, rounds, role)
    stream = SampleStream.from_config(path=cfg["data"]["path"], seq_len=train["seq_len"], seed=train["seed"])
    conn.send(("ready", spec.rank))
    for step in range(train["steps"]):
        start = time.perf_counter()
        result = run_step(
            step, plan=plan, role=role, state=state, stream=stream, gen=gen, model=model, train=train,
            rounds=rounds, tp=tp,
        )
        state.optimizer_step()
        conn.send(("step", spec.rank, step, result.loss_sum, result.sample_ids, time.perf_counter() - start))
    if cfg["output"]["save_params"] and role.pipeline == 0:
        params_dir = Path(spec.run_dir) / ".params"
        params_dir.mkdir(parents=True, exist_ok=True)
        torch.save(state.shards(), params_dir / f"rank{spec.rank}.pt")
    gen.close()
    conn.send(("done", spec.rank))
