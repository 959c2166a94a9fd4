"""Process-group build time and store load against the number of ranks: one world group, or Chameleon's groups.

Usage::

    python benchmarks/bench_groups.py [--ranks 2 4 8 16 32 64 128] [--processes 4] [--json FILE]

For each rank count N, N gloo ranks on loopback (threads spread over ``--processes``
processes, one store client each, every operation counted) build, from one common
start:

- **world**: one group over all N ranks, as a generation built before this wave did
  (gloo connects every pair of its ranks: N − 1 connections per rank, and each rank
  makes 2N + 1 store operations to find the others);
- **plan**: the groups a generation of a dp × pp plan of N devices builds now
  (``layout.groups.plan_groups``: each stage's gradient-sync group over its dp replicas and the
  pairs of neighbouring stages), pp = min(8, N / 2).

Printed per N and kind: the slowest rank's build time, store operations per rank, and
connections per rank. Gloo's connections use loopback ports, so N stops at 128 here
(N(N−1)/2 connections for a world group).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _common import header

from chameleon.layout.groups import plan_groups
from chameleon.layout.plan import even_plan
from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of
from chameleon.runtime.worker import comm

TIMEOUT = timedelta(seconds=300)
MODEL = ModelConfig(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)


def groups_of(kind: str, n: int) -> list[tuple[int, ...]]:
    if kind == "world":
        return [tuple(range(n))]
    pp = min(8, max(1, n // 2))
    plan = even_plan(dp=n // pp, pp=pp, tp=1, n_layers=8, global_batch=8 * (n // pp), micro_batch=1)
    return plan_groups(plan, spec_of(MODEL).layout(MODEL, plan))


def ranks(kind: str, n: int, mine: list[int], port: int, out) -> None:
    """Build ``kind``'s groups for the ranks ``mine`` (threads of this process) and report each one's figures."""
    groups = groups_of(kind, n)
    start = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    results = {}

    def one(me: int) -> None:
        client = comm.CountedStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT))
        start.wait(["go"])
        t0 = time.perf_counter()
        built = [comm.build_group("gloo", dist.PrefixStore(comm.group_prefix(0, g), client), g.index(me), len(g),
                                 TIMEOUT, "127.0.0.1", torch.device("cpu")) for g in sorted(groups) if me in g and len(g) > 1]
        results[me] = (time.perf_counter() - t0, sum(len(g) - 1 for g in groups if me in g and len(g) > 1), len(built))

    threads = [threading.Thread(target=one, args=(me,)) for me in mine]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ops = comm.store_ops()  # this process's ranks together, the start wait excluded (not a counted client)
    out.put((results, ops, len(mine)))
    start.set(f"done{os.getpid()}", "1")
    start.wait(["all done"])  # keep the groups' connections open until every rank is built


def measure(kind: str, n: int, processes: int) -> dict:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    out = ctx.SimpleQueue()
    k = min(processes, n)
    shares = [list(range(i, n, k)) for i in range(k)]
    procs = [ctx.Process(target=ranks, args=(kind, n, mine, store.port, out), daemon=True) for mine in shares]
    for p in procs:
        p.start()
    time.sleep(0.5 + 0.01 * n)  # every rank connected to the store and waiting
    store.set("go", "1")
    reports = [out.get() for _ in procs]
    store.set("all done", "1")
    for p in procs:
        p.join(timeout=60)
    times = [t for results, _, _ in reports for t, _, _ in results.values()]
    links = [c for results, _, _ in reports for _, c, _ in results.values()]
    built = [b for results, _, _ in reports for _, _, b in results.values()]
    ops = sum(o for _, o, _ in reports)
    return {"kind": kind, "ranks": n, "build_s_max": max(times), "build_s_median": statistics.median(times),
            "store_ops_per_rank": ops / n, "connections_per_rank": statistics.mean(links),
            "groups_per_rank": statistics.mean(built)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--json")
    args = parser.parse_args()
    header(f"gloo on loopback, ranks as threads in {args.processes} processes")
    print("| ranks | kind | slowest build (s) | median build (s) | store ops per rank | connections per rank | groups per rank |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for n in args.ranks:
        for kind in ("world", "plan"):
            r = measure(kind, n, args.processes)
            rows.append(r)
            print(f"| {n} | {kind} | {r['build_s_max']:.3f} | {r['build_s_median']:.3f} | {r['store_ops_per_rank']:.1f} | "
                  f"{r['connections_per_rank']:.1f} | {r['groups_per_rank']:.1f} |", flush=True)
    print(f"load avg after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
