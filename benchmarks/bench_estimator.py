"""Estimated vs measured step time of real training runs on this machine.

Run: ``python benchmarks/bench_estimator.py [--steps 15] [--plans dp4 pp4 ...]``.

The tiny model is profiled with the real profiler (``cluster=local``, a fresh
measurement in a temporary cache unless ``--cache-dir`` is given), then each plan
trains for ``--steps`` steps with ``python -m chameleon.train`` (real worker
processes, gloo) and its ``mean_step_time_s`` (steps after the first) is set
beside ``estimate_step`` of the same composed plan. The last column is the
1-minute load average after the run: the host's cores are shared with other
users. Rerouted plans are measured after a real fault: a worker is SIGKILLed in step
2 under ``policy=reroute`` and the steady post-recovery step time (generation 1, its
first step excluded) is set beside the estimate of the reroute plan, with Eq. 13's
extra slots taken both ways (``max`` over stages and ``sum``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from chameleon.config import CONF_DIR, build_plan, model_config, register_configs
from chameleon.decision.config import ClusterConfig
from chameleon.decision.estimator import estimate_step
from chameleon.decision.profiler import load_profile
from chameleon.decision.selector import reroute_plan

# No injected fault; plans below start from plain DP over launcher.nproc_per_node workers (conf/parallel/dp.yaml).
BASE = ("failure=none", "parallel=dp", "train.seq_len=64", "train.global_batch=16", "train.micro_batch=4")
PLANS = {
    "dp1": ("launcher.nproc_per_node=1",),
    "dp2": ("launcher.nproc_per_node=2",),
    "pp2": ("launcher.nproc_per_node=2", "parallel.dp=1", "parallel.pp=2"),
    "dp4": ("launcher.nproc_per_node=4", "parallel.dp=4"),
    "dp2×pp2": ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2"),
    "pp4": ("launcher.nproc_per_node=4", "parallel.dp=1", "parallel.pp=4"),
    "pp2+pp3": ("launcher.nproc_per_node=5", "parallel.pipelines=[{layers:[2,2],micro_batches:2},{layers:[1,1,2],micro_batches:2}]"),
    "pp3+pp4": ("launcher.nproc_per_node=7", "parallel.pipelines=[{layers:[1,1,2],micro_batches:2},{layers:[1,1,1,1],micro_batches:2}]"),
    "dp2×tp2": ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.tp=2"),
}
# Rerouted plans: (the plan before the fault, the device killed in step 2).
REROUTED = {
    "dp2×pp2 rr": (("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2"), 1),
    "dp2×pp3 rr": (("launcher.nproc_per_node=6", "parallel.dp=2", "parallel.pp=3"), 4),
}


def measure(overrides: tuple[str, ...], run_dir: Path, steps: int) -> dict:
    """Train with ``overrides`` in real worker processes; the run's summary.json (and metrics lines)."""
    cmd = [sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", "output.progress=false",
           "launcher.timeout_s=300", f"train.steps={steps}", *BASE, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["metrics"] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--plans", nargs="+", default=[*PLANS, *REROUTED], choices=[*PLANS, *REROUTED])
    parser.add_argument("--cache-dir", default=None, help="profile cache (default: a fresh temporary one)")
    args = parser.parse_args()
    register_configs()
    print("command:", shlex.join([sys.executable] + sys.argv))
    print(f"env: Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        base = compose(config_name="config", overrides=list(BASE))
        cluster = replace(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClusterConfig), base.cluster)),
                          cache_dir=args.cache_dir or tmp)
        model = model_config(base)
        profile = load_profile(model, cluster, micro_batch=base.train.micro_batch, seq_len=base.train.seq_len,
                               threads=base.launcher.threads_per_worker)
        print(f"profile: {profile.source}; layer fwd {profile.layer_fwd_s * 1e3:.2f} ms, bwd "
              f"{profile.layer_bwd_s * 1e3:.2f} ms, head fwd {profile.last_fwd_s * 1e3:.2f} ms, "
              f"bwd {profile.last_bwd_s * 1e3:.2f} ms, p2p {profile.p2p_latency_s * 1e6:.0f} µs, "
              f"all-reduce {profile.dp_latency_s * 1e6:.0f} µs + {profile.dp_bw / 1e9:.2f} GB/s")
        at_tp = lambda tp: load_profile(model, cluster, micro_batch=base.train.micro_batch,  # noqa: E731
                                        seq_len=base.train.seq_len, tp=tp, threads=base.launcher.threads_per_worker)
        print(f"{'plan':<9} {'procs':>5} {'est. s':>8} {'meas. s':>8} {'error':>7} {'load':>5}  estimate parts")
        errors, shared = [], []
        for name in args.plans:
            overrides, killed = (REROUTED[name][0], REROUTED[name][1]) if name in REROUTED else (PLANS[name], None)
            cfg = compose(config_name="config", overrides=[*BASE, *overrides])
            plan = build_plan(cfg)
            run_dir = Path(tmp) / name.replace("×", "x").replace("+", "_").replace(" ", "_")
            if killed is None:
                est = estimate_step(at_tp(cfg.parallel.tp), plan)
                summary = measure(overrides, run_dir, args.steps)
                measured = summary["mean_step_time_s"]
            else:
                plan = reroute_plan(plan, {killed})
                est = estimate_step(profile, plan, reroute_slots="max")
                alt = estimate_step(profile, plan, reroute_slots="sum")
                fault = ("failure=kill", f"failure.rank={killed}", "failure.step=2", "failure.phase=forward",
                         "policy=reroute")
                summary = measure((*overrides, *fault), run_dir, args.steps)
                after = [m["step_time_s"] for m in summary["metrics"] if m["generation"] == 1][1:]
                measured = statistics.mean(after)
                print(f"  (Eq. 13 with sum over stages: {alt.t_step:.4f} s, "
                      f"{100 * (alt.t_step - measured) / measured:+.1f}%)")
            errors.append(abs(est.t_step - measured) / measured)
            shared.append(est.cpu_share > 1)
            print(f"{name:<9} {cfg.launcher.nproc_per_node:>5} {est.t_step:>8.4f} {measured:>8.4f} "
                  f"{100 * (est.t_step - measured) / measured:>+6.1f}% {os.getloadavg()[0]:>5.2f}  "
                  f"1F1B {est.shared_compute or est.compute:.4f} (alone {est.compute:.4f}) + {est.cpu_share:g} × "
                  f"(sync {est.sync:.4f} in {est.sync_rounds} rounds + optimizer {est.optimizer:.4f})", flush=True)
    print(f"median |error| {100 * statistics.median(errors):.1f}% over {len(errors)} plans "
          f"(goal ≤ 10%); max {100 * max(errors):.1f}%")
    for label, group in (("processes ≤ cores", False), ("processes > cores", True)):
        part = [e for e, s in zip(errors, shared) if s == group]
        if part:
            print(f"  {label}: median |error| {100 * statistics.median(part):.1f}% over {len(part)} plans")


if __name__ == "__main__":
    main()
