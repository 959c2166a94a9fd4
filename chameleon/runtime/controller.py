"""The controller: hosts the c10d store, spawns and watches the workers, books every step.

It holds no model state. Workers report each finished step over a pipe; a step
is *committed* once every worker has reported it, and the controller then checks
that the step trained exactly the global samples ``[k·B, (k+1)·B)`` — each once —
before writing its metrics line.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from chameleon.config import model_config
from chameleon.data.stream import sample_ids_digest
from chameleon.layout.plan import Plan
from chameleon.model.llama import param_shapes
from chameleon.report.outputs import JsonLines, write_json
from chameleon.runtime.worker import WorkerSpec, worker_main

JOIN_TIMEOUT_S = 30.0


class TrainingError(RuntimeError):
    """A worker failed in a way the run cannot survive; the message says which and why."""


@dataclass
class StepBook:
    """Collects per-worker reports of one step until every worker has reported."""

    loss: float = 0.0
    sample_ids: list[int] = field(default_factory=list)
    step_time_s: float = 0.0
    reported: set[int] = field(default_factory=set)


@dataclass
class RunResult:
    losses: list[float]
    step_times: list[float]
    per_step_ids: list[list[int]]
    startup_s: float | None
    wall_s: float


def run_training(config: dict, *, plan: Plan, run_dir: Path) -> Path:
    """Train as ``config`` says, write ``metrics.jsonl``, ``summary.json`` and ``final_params.pt``.

    Returns:
        The path of ``summary.json``.

    Raises:
        TrainingError: when a worker raises or dies.
    """
    launcher, train = config["launcher"], config["train"]
    world = launcher["nproc"]
    store = dist.TCPStore(
        launcher["master_addr"], launcher["master_port"], is_master=True,
        timeout=timedelta(seconds=launcher["timeout_s"]), wait_for_workers=False,
    )
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    started = time.perf_counter()
    for rank in range(world):
        recv_end, send_end = ctx.Pipe(duplex=False)
        spec = WorkerSpec(rank, world, launcher["master_addr"], store.port, config, str(run_dir))
        proc = ctx.Process(target=worker_main, args=(spec, send_end), name=f"chameleon-worker-{rank}", daemon=True)
        proc.start()
        send_end.close()
        procs.append(proc)
        conns.append(recv_end)
    try:
        result = _watch(procs, conns, config=config, run_dir=run_dir, started=started)
    finally:
        _reap(procs)
    if config["output"]["save_params"]:
        _merge_params(run_dir, param_shapes(model_config(config)))
    return _write_summary(run_dir, config=config, plan=plan, result=result)


def _watch(procs: list, conns: list[Connection], *, config: dict, run_dir: Path, started: float) -> RunResult:
    train = config["train"]
    world, steps = len(procs), train["steps"]
    books: dict[int, StepBook] = {}
    losses, step_times, per_step_ids = [], [], []
    metrics = JsonLines(run_dir / "metrics.jsonl")
    bar = tqdm(total=steps, desc="train", unit="step", disable=not config["output"]["progress"], leave=False)
    ready, done, startup_s = set(), set(), None
    open_conns = {c: r for r, c in enumerate(conns)}
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    try:
        while len(done) < world:
            for item in wait([*open_conns, *sentinels], timeout=config["launcher"]["timeout_s"]) or [None]:
                if item is None:
                    raise TrainingError(f"no worker reported for launcher.timeout_s={config['launcher']['timeout_s']} s")
                if item in sentinels:
                    rank = sentinels.pop(item)
                    if rank not in done and procs[rank].exitcode != 0:
                        _drain(item, open_conns)
                        raise TrainingError(f"worker {rank} died (exit code {procs[rank].exitcode})")
                    continue
                try:
                    msg = item.recv()
                except EOFError:
                    open_conns.pop(item)
                    continue
                kind, rank = msg[0], msg[1]
                if kind == "error":
                    raise TrainingError(f"worker {rank} failed:\n{msg[2]}")
                if kind == "ready":
                    ready.add(rank)
                    if len(ready) == world:
                        startup_s = time.perf_counter() - started
                elif kind == "done":
                    done.add(rank)
                elif kind == "step":
                    _, _, step, loss, ids, dt = msg
                    book = books.setdefault(step, StepBook())
                    book.loss += loss
                    book.sample_ids.extend(ids)
                    book.step_time_s = max(book.step_time_s, dt)
                    book.reported.add(rank)
                    if len(book.reported) == world:
                        _commit(step, books.pop(step), train=train, metrics=metrics)
                        losses.append(book.loss)
                        step_times.append(book.step_time_s)
                        per_step_ids.append(sorted(book.sample_ids))
                        bar.update(1)
                        bar.set_postfix(loss=f"{book.loss:.4f}")
    finally:
        bar.close()
        metrics.close()
    return RunResult(losses, step_times, per_step_ids, startup_s, time.perf_counter() - started)


def _drain(sentinel, open_conns: dict) -> None:
    """Surface an error message a dying worker managed to send before exiting."""
    for conn in list(open_conns):
        while conn.poll():
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] == "error":
                raise TrainingError(f"worker {msg[1]} failed:\n{msg[2]}")


def _commit(step: int, book: StepBook, *, train: dict, metrics: JsonLines) -> None:
    """Check the step trained each of its global samples exactly once; log its metrics."""
    batch = train["global_batch"]
    expected = list(range(step * batch, (step + 1) * batch))
    if sorted(book.sample_ids) != expected:
        raise TrainingError(
            f"step {step} trained samples {sorted(book.sample_ids)} instead of [{expected[0]}, {expected[-1] + 1}): "
            "samples were lost or duplicated"
        )
    dt = book.step_time_s
    metrics.write({
        "step": step,
        "loss": book.loss,
        "samples_per_s": batch / dt,
        "tokens_per_s": batch * train["seq_len"] / dt,
        "step_time_s": dt,
    })


def _reap(procs: list) -> None:
    """Join every worker; kill the ones that do not exit in time. No process is left behind."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()) if proc.exitcode is None else 0)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _merge_params(run_dir: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Assemble pipeline 0's parameter shards (one file per rank) into full tensors in ``final_params.pt``."""
    parts = sorted((run_dir / ".params").glob("rank*.pt"))
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, (region, shard) in torch.load(part, weights_only=True).items():
            full = merged.setdefault(name, torch.empty(shapes[name]))
            full[tuple(slice(a, b) for a, b in region)] = shard
        part.unlink()
    if parts:
        (run_dir / ".params").rmdir()
        torch.save({n: merged[n] for n in shapes if n in merged}, run_dir / "final_params.pt")


def _write_summary(run_dir: Path, *, config: dict, plan: Plan, result: RunResult) -> Path:
    train = config["train"]
    steady = result.step_times[1:] or result.step_times
    samples_per_s = train["global_batch"] * len(steady) / sum(steady)
    return write_json(run_dir / "summary.json", {
        "steps_completed": len(result.losses),
        "final_loss": result.losses[-1] if result.losses else None,
        "losses": result.losses,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * train["seq_len"],
        "mean_step_time_s": sum(steady) / len(steady),
        "world_size": config["launcher"]["nproc"],
        "plan": plan.describe(),
        "sample_ids_digest": sample_ids_digest(result.per_step_ids),
        "startup_s": result.startup_s,
        "wall_s": result.wall_s,
    })
