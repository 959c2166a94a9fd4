"""Planner wall time at 32–4096 devices for a Llama-2-7B-shaped model, full DP and length ranges.

Run: ``python benchmarks/bench_planner.py [--cluster a100_32] [--global-batch 1024]``.
One device has failed at each scale (N−1 survivors, so uneven plans are in play). The smallest scale is
planned once, untimed, first: the first plan of a process also pays for lazy imports and first-use caches.
Each timed search starts with the estimator's remembered pipeline times dropped (a cold search); the
``cached`` column asks the same planner again.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from chameleon.config import CONF_DIR
from chameleon.decision import estimator
from chameleon.decision.config import ClusterConfig
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import load_profile
from chameleon.model.config import ModelConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cluster", default="a100_32")
    parser.add_argument("--global-batch", type=int, default=1024, help="sequences of 4096 tokens (micro-batch 1)")
    parser.add_argument("--scales", type=int, nargs="+", default=[32, 256, 1024, 4096])
    args = parser.parse_args()
    model = ModelConfig(**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "llama7b.yaml")))
    base = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), OmegaConf.load(CONF_DIR / "cluster" / f"{args.cluster}.yaml")))
    warm = min(args.scales)
    Planner(load_profile(model, replace(base, n_devices=warm), micro_batch=1, seq_len=4096)).best(
        [(d,) for d in range(warm - 1)], n_micro=args.global_batch, micro_batch_size=1)
    print("command:", " ".join(["python", "benchmarks/bench_planner.py", *sys.argv[1:]]))
    print(f"env: Python {platform.python_version()}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"(after one untimed plan at {warm} devices; each search starts with the estimator's memory dropped)")
    print(f"{'devices':>8} {'survivors':>9} {'setup s':>8} {'search s':>9} {'cached s':>9} {'step s':>8}  plan")
    for n in args.scales:
        cluster = replace(base, n_devices=n)
        profile = load_profile(model, cluster, micro_batch=1, seq_len=4096)
        estimator.forget()
        start = time.perf_counter()
        planner = Planner(profile)
        setup = time.perf_counter() - start
        units = [(d,) for d in range(n - 1)]
        start = time.perf_counter()
        result = planner.best(units, n_micro=args.global_batch, micro_batch_size=1)
        search = time.perf_counter() - start
        start = time.perf_counter()
        planner.best(units, n_micro=args.global_batch, micro_batch_size=1)
        again = time.perf_counter() - start
        lengths = sorted({p.n_stages for p in result.plan.pipelines})
        print(f"{n:>8} {n - 1:>9} {setup:>8.3f} {search:>9.3f} {again:>9.3f} {result.estimate.t_step:>8.3f}  "
              f"dp={result.plan.dp} lengths={lengths}")


if __name__ == "__main__":
    main()
