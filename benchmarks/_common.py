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

from chameleon.runtime.comm import connect_store

HOST = "127.0.0.1"
TIMEOUT_S = 300.0


def header() -> None:
    """Print the command and the environment."""
    print("command:", " ".join([os.path.relpath(sys.executable)] + sys.argv))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"env: Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPU cores "
          f"(load avg {load}), gloo, 1 thread per worker", flush=True)


def launch(target: Callable, world: int, *args) -> list:
    """Run ``target(rank, world, store, *args)`` in ``world`` fresh processes; return each rank's result.

    The TCPStore lives here, as in the controller; workers fork from a forkserver that
    has imported torch once.
    """
    server = dist.TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.pipelining", "chameleon.runtime.schedule"])
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


def timed(fn: Callable[[], None], barrier: Callable[[], None]) -> float:
    """Seconds ``fn`` takes on this rank, started right after a barrier so every rank starts together."""
    barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_times(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's time (a step ends when its last rank is done)."""
    return [max(ts) for ts in zip(*per_rank)]


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)
