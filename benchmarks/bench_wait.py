"""One gloo all-reduce's wait: handed to a waiter thread (as every wait was) against a sliced wait on the caller's thread.

Run: ``python benchmarks/bench_wait.py [--numel 16384] [--rounds 6] [--iters 500]``.

Two gloo processes all-reduce a tensor of ``--numel`` floats (by default one TP all-reduce of
``bench_step``'s activations: micro-batch 2 × 64 tokens × dim 128) ``--iters`` times per block,
waiting each one out in one of two ways, both checking the fault flag every
``POLL_INTERVAL_S`` while they wait:

- **handoff**: ``Work.wait()`` runs on :class:`~chameleon.runtime.worker.comm.Generation`'s waiter
  thread while the caller polls its completion (what ``Generation.wait`` does for point-to-point ops);
- **sliced**: :class:`~chameleon.runtime.worker.completion.Collective` — ``Work.wait(timeout)`` on the
  caller's thread in slices, a check between them (what it does for gloo collectives).

Blocks alternate (``--rounds`` pairs); each figure is rank 0's median microseconds per all-reduce.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _common import TIMEOUT_S, header, launch

from chameleon.runtime.worker.comm import POLL_INTERVAL_S, _Waiter
from chameleon.runtime.worker.completion import Collective


def _worker(rank: int, world: int, store, numel: int, rounds: int, iters: int) -> dict[str, list[float]]:
    group = dist.ProcessGroupGloo(dist.PrefixStore("wait", store), rank, world, timedelta(seconds=TIMEOUT_S))
    waiter = _Waiter(name="bench-waiter")
    tensor = torch.ones(numel)

    def check() -> None:
        """The fault check between slices (no fault here)."""

    def handoff() -> None:
        pending = waiter.submit(group.allreduce([tensor]).wait)
        while not pending.done.wait(POLL_INTERVAL_S):
            check()

    def sliced() -> None:
        Collective(group.allreduce([tensor])).wait(check, interval_s=POLL_INTERVAL_S)

    times: dict[str, list[float]] = {"handoff": [], "sliced": []}
    for _ in range(rounds):
        for name, wait in (("handoff", handoff), ("sliced", sliced)):
            start = time.perf_counter()
            for _ in range(iters):
                wait()
            times[name].append((time.perf_counter() - start) / iters * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2 * 64 * 128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=500)
    args = parser.parse_args()
    header()
    times = launch(_worker, 2, args.numel, args.rounds, args.iters)[0]
    for name, blocks in times.items():
        print(f"{name:8s} median {statistics.median(blocks):7.0f} µs per all-reduce; blocks "
              + " ".join(f"{t:.0f}" for t in blocks))
    ratio = statistics.median(times["handoff"]) / statistics.median(times["sliced"])
    print(f"handoff ÷ sliced: {ratio:.2f}")


if __name__ == "__main__":
    main()
