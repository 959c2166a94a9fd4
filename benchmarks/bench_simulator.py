"""Simulator wall time: 30 days on 4,096 devices under MTBF-driven faults, Chameleon's policy.

Run: ``python benchmarks/bench_simulator.py [--devices 4096] [--days 30] [--policies chameleon]``.
Llama-2-7B shape on the analytic Ascend-910B profile, global batch 4096 × 4096 tokens, the
initial plan from the planner; faults per device with a 50,000 h MTBF (about Llama 3's rate)
plus whole-node faults every 200,000 h per node, devices back after 4 h.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch
from hydra import compose, initialize_config_dir

from chameleon.config import CONF_DIR, register_configs
from chameleon.simulate import prepare
from chameleon.sim.engine import simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=4096)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--global-batch", type=int, default=4096)
    parser.add_argument("--policies", nargs="+", default=["chameleon"])
    args = parser.parse_args()
    register_configs()
    overrides = [
        "+recipe=llama7b", "cluster=ascend910b_32", f"cluster.n_devices={args.devices}", f"train.global_batch={args.global_batch}",
        "sim.initial=planner", f"sim.horizon_h={24 * args.days}", "trace=poisson", "trace.node_mtbf_h=200000",
    ]
    print("command:", " ".join([sys.executable] + sys.argv))
    print(f"env: Python {platform.python_version()}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print("overrides:", " ".join(overrides))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    start = time.perf_counter()
    setup, events, horizon_s, _ = prepare(cfg)
    setup_s = time.perf_counter() - start
    print(f"setup (profile, planner, initial plan, trace of {len(events)} events): {setup_s:.2f} s; "
          f"initial plan dp={setup.plan.dp}, step {setup.planning.t_step(setup.plan):.3f} s")
    for name in args.policies:
        start = time.perf_counter()
        res = simulate(setup, name, events, horizon_s=horizon_s)
        wall = time.perf_counter() - start
        faults = sum(r["choice"] not in ("rejoin", "heal") for r in res.recoveries)
        print(f"{name}: {wall:.2f} s wall for {args.days:g} days, {faults} faults handled, "
              f"{res.throughput:.1f} samples/s ({res.throughput / res.failure_free_throughput:.4f} of failure-free)")


if __name__ == "__main__":
    main()
