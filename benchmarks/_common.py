"""Shared by the runtime benchmarks: a launcher of real gloo worker processes, timing helpers, the environment line."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chameleon.runtime.worker.comm import connect_store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
TIMEOUT_S = 300.0


def header(setting: str = "gloo, 1 thread per worker") -> None:
    """Print the command as run from the repository root, and the environment (load included)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    print("command:", " ".join(["python", script, *sys.argv[1:]]))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"env: Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPU cores "
          f"(load avg {load}), {setting}", flush=True)


def launch(target: Callable, world: int, *args) -> list:
    """Run ``target(rank, world, store, *args)`` in ``world`` fresh processes; return each rank's result.

    The TCPStore lives here, as in the controller; workers fork from a forkserver that
    has imported torch once.
    """
    server = dist.TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.pipelining", "chameleon.runtime.worker.schedule"])
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_entry, args=(target, r, world, server.port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors = []
    for _ in range(world):
        rank, ok, payload = results.get()
        if not ok:
            errors.append(f"rank {rank}:\n{payload}")
            break
        out[rank] = payload
    for p in procs:
        p.join(timeout=0 if errors else 30)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RuntimeError("a benchmark worker failed\n" + "\n".join(errors))
    return [out[r] for r in range(world)]


def _entry(target: Callable, rank: int, world: int, port: int, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        store = connect_store(HOST, port, timeout_s=TIMEOUT_S)
        results.put((rank, True, target(rank, world, store, *args)))
    except BaseException:  # noqa: BLE001 - reported to the launcher
        results.put((rank, False, traceback.format_exc()))


def timed(fn: Callable[[], None], barrier: Callable[[], None]) -> tuple[float, float]:
    """Wall and CPU seconds (all threads) ``fn`` takes on this rank, started right after a barrier."""
    barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


Timings = dict[str, list[list[tuple[float, float]]]]
"""One rank's ``timed`` results: per implementation, per block, per step."""


def compare(per_rank: list[Timings], a: str, b: str) -> tuple[dict[str, float], dict[str, float], str]:
    """Medians over all measured steps of ``a`` and ``b``: wall ms, CPU ms, and per-block wall ``a/b``.

    A step's wall time is its slowest rank's (the step ends with it); its CPU time is
    the sum over ranks.
    """
    wall: dict[str, list[list[float]]] = {}
    cpu: dict[str, list[float]] = {}
    for k in (a, b):
        wall[k], cpu[k] = [], []
        for i in range(len(per_rank[0][k])):
            steps = list(zip(*(r[k][i] for r in per_rank)))
            wall[k].append([max(w for w, _ in s) for s in steps])
            cpu[k] += [sum(c for _, c in s) for s in steps]
    blocks = " ".join(f"{_median_ms(x):.0f}/{_median_ms(y):.0f}" for x, y in zip(wall[a], wall[b]))
    return ({k: _median_ms([t for block in wall[k] for t in block]) for k in (a, b)},
            {k: _median_ms(cpu[k]) for k in (a, b)}, blocks)


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)
