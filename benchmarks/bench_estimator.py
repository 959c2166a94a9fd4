"""Estimated vs measured step time of real training runs on this machine.

Run: ``python benchmarks/bench_estimator.py [--steps 15] [--plans dp4 pp4 ...] [--save runs.json]``.

The tiny model is profiled with the real profiler (``cluster=local``, a fresh
measurement in a temporary cache unless ``--cache-dir`` is given), then each plan
trains for ``--steps`` steps with ``python -m chameleon.train`` (real worker
processes, gloo) and its steady step time (steps after the first) is set beside
``estimate_step`` of the plan that ran. Plans with faults are measured after real
SIGKILLs (``failure=schedule``): under ``policy=reroute`` (one or two rerouted
stages) or ``policy=dynamic`` (the planner's plan for the survivors), the plan is
the one the decision recorded and the time is that of the last generation, its
first step excluded. Every plan is estimated with the ``policy.reroute_slots`` its run had (the runtime's
policy's, ``max`` by default); rerouted plans also show the other two modes.

The host's cores are shared with other users' jobs: before and after each run
the profiler's probe (:func:`measure_background`) counts the busy processes of
others (column ``busy``, the mean), and the estimate uses that count; ``load`` is the 1-minute load
average after the run.
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
from dataclasses import asdict, replace
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from chameleon.config import CONF_DIR, build_plan, model_config, register_configs
from chameleon.decision.config import ClusterConfig
from chameleon.decision.estimator import REROUTE_SLOTS, estimate_step
from chameleon.decision.profiler import load_profile, measure_background
from chameleon.layout.plan import Pipeline, Plan, Recompute, Reroute, Stage

# No injected fault; plans below start from plain DP over launcher.nproc_per_node workers (conf/parallel/dp.yaml).
BASE = ("failure=none", "parallel=dp", "train.seq_len=64", "train.global_batch=16", "train.micro_batch=4")


def _pipes(*layers: tuple[int, ...]) -> str:
    specs = ",".join(f"{{layers:[{','.join(map(str, ls))}],micro_batches:{4 // len(layers)}}}" for ls in layers)
    return f"parallel.pipelines=[{specs}]"


def _kills(policy: str, *kills: tuple[int, int]) -> tuple[str, ...]:
    faults = ",".join(f"{{kind:kill,rank:{rank},step:{step},phase:forward}}" for rank, step in kills)
    return ("failure=schedule", f"failure.faults=[{faults}]", f"policy={policy}")


# name: (overrides of the plan before any fault, overrides adding real SIGKILLs and the recovery policy).
PLANS = {
    "dp1": (("launcher.nproc_per_node=1",), ()),
    "dp2": (("launcher.nproc_per_node=2",), ()),
    "dp3": (("launcher.nproc_per_node=3", "train.global_batch=12"), ()),
    "dp4": (("launcher.nproc_per_node=4", "parallel.dp=4"), ()),
    "pp2": (("launcher.nproc_per_node=2", "parallel.dp=1", "parallel.pp=2"), ()),
    "pp3": (("launcher.nproc_per_node=3", "parallel.dp=1", "parallel.pp=3"), ()),
    "pp4": (("launcher.nproc_per_node=4", "parallel.dp=1", "parallel.pp=4"), ()),
    "dp2×pp2": (("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2"), ()),
    "dp2×pp3": (("launcher.nproc_per_node=6", "parallel.dp=2", "parallel.pp=3"), ()),
    "dp3×pp2": (("launcher.nproc_per_node=6", "parallel.dp=3", "parallel.pp=2", "train.global_batch=12"), ()),
    "pp1+pp2": (("launcher.nproc_per_node=3", _pipes((4,), (1, 3))), ()),
    "pp2+pp3": (("launcher.nproc_per_node=5", _pipes((2, 2), (1, 1, 2))), ()),
    "pp3+pp4": (("launcher.nproc_per_node=7", _pipes((1, 1, 2), (1, 1, 1, 1))), ()),
    "pp1+pp3": (("launcher.nproc_per_node=4", _pipes((4,), (2, 1, 1))), ()),
    "tp2": (("launcher.nproc_per_node=2", "parallel.dp=1", "parallel.tp=2"), ()),
    "dp2×tp2": (("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.tp=2"), ()),
    "pp2×tp2": (("launcher.nproc_per_node=4", "parallel.dp=1", "parallel.pp=2", "parallel.tp=2"), ()),
    "dp2×pp2 rr": (("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2"), _kills("reroute", (1, 2))),
    "dp2×pp3 rr": (("launcher.nproc_per_node=6", "parallel.dp=2", "parallel.pp=3"), _kills("reroute", (4, 2))),
    "dp2×pp3 rr×2": (("launcher.nproc_per_node=6", "parallel.dp=2", "parallel.pp=3"),
                     _kills("reroute", (1, 2), (5, 4))),
    "dp3×pp2 rr×2": (("launcher.nproc_per_node=6", "parallel.dp=3", "parallel.pp=2", "train.global_batch=12"),
                     _kills("reroute", (1, 2), (2, 4))),
    "dp3 dyn": (("launcher.nproc_per_node=3", "train.global_batch=12"), _kills("dynamic", (1, 2))),
    "dp2×pp2 dyn": (("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2"), _kills("dynamic", (1, 2))),
    "dp2×pp3 dyn": (("launcher.nproc_per_node=6", "parallel.dp=2", "parallel.pp=3"), _kills("dynamic", (4, 2))),
}


def measure(overrides: tuple[str, ...], run_dir: Path, steps: int) -> dict:
    """Train with ``overrides`` in real worker processes; the run's summary.json (and metrics lines)."""
    cmd = [sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", "output.progress=false",
           "launcher.timeout_s=300", f"train.steps={steps}", "train.eval_interval=0", *BASE, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["metrics"] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary


def plan_from_dict(d: dict) -> Plan:
    """The plan a decision recorded (``dataclasses.asdict`` of it) as a :class:`Plan`."""
    pipelines = tuple(
        Pipeline(tuple(Stage(tuple(st["devices"]), tuple(st["layers"]), Recompute(st["recompute"]))
                       for st in p["stages"]), p["micro_batches"])
        for p in d["pipelines"]
    )
    reroutes = tuple(Reroute(r["pipeline"], r["stage"], tuple(r["hosts"])) for r in d["reroutes"])
    return Plan(d["n_layers"], d["micro_batch_size"], pipelines, reroutes)


def run_plan(name: str, run_dir: Path, steps: int, cores: float) -> dict:
    """Train plan ``name`` for real: the plan that ran last, its steady step time, others' busy processes (the
    profiler's probe, mean of before and after), the load average after and the run's ``policy.reroute_slots``."""
    overrides, faults = PLANS[name]
    before = measure_background(cores)
    summary = measure((*overrides, *faults), run_dir, steps)
    background = (before + measure_background(cores)) / 2
    cfg = compose(config_name="config", overrides=[*BASE, *overrides, *faults])
    if not faults:
        plan, measured = build_plan(cfg), summary["mean_step_time_s"]
    else:
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        decision = [e for e in events if e["event"] == "fault"][-1]["decision"]
        chosen = next(c for c in decision["candidates"] if c["name"] == decision["choice"])
        plan = plan_from_dict(chosen["plan"])
        last = max(m["generation"] for m in summary["metrics"])
        measured = statistics.mean([m["step_time_s"] for m in summary["metrics"] if m["generation"] == last][1:])
    return {"name": name, "plan": asdict(plan), "measured_s": measured, "load": os.getloadavg()[0],
            "procs": len(plan.devices), "background_procs": background, "reroute_slots": cfg.policy.reroute_slots}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--cache-dir", default=None, help="profile cache (default: a fresh temporary one)")
    parser.add_argument("--save", default=None, help="write the profile and the measured runs to this JSON file")
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
        runtime_slots = base.policy.reroute_slots
        at_tp = lambda tp: load_profile(model, cluster, micro_batch=base.train.micro_batch,  # noqa: E731
                                        seq_len=base.train.seq_len, tp=tp, threads=base.launcher.threads_per_worker)
        profile = at_tp(1)
        print(f"profile: {profile.source}; layer fwd {profile.layer_fwd_s * 1e3:.2f} ms, bwd "
              f"{profile.layer_bwd_s * 1e3:.2f} ms, head fwd {profile.last_fwd_s * 1e3:.2f} ms, "
              f"bwd {profile.last_bwd_s * 1e3:.2f} ms, p2p {profile.p2p_latency_s * 1e6:.0f} µs, "
              f"all-reduce {profile.dp_latency_s * 1e6:.0f} µs + {profile.dp_bw / 1e9:.2f} GB/s")
        for terms in profile.tp_terms:
            fwd, bwd = profile.layer_s(terms.tp)
            print(f"  tp{terms.tp} layer: fwd {fwd * 1e3:.2f} ms, bwd {bwd * 1e3:.2f} ms (compute ÷ {terms.tp} + TP "
                  f"terms {terms.fwd_s * 1e3:.2f} and {terms.bwd_s * 1e3:.2f} ms, of which idle "
                  f"{terms.fwd_idle_s * 1e3:.2f} and {terms.bwd_idle_s * 1e3:.2f} ms)")
        print(f"{'plan':<13} {'procs':>5} {'est. s':>8} {'meas. s':>8} {'error':>7} {'busy':>5} {'load':>5} "
              f"{'quiet':>7}  estimate parts")
        runs, errors, shared, quiet = [], [], [], []
        tp_errors: list[float] = []
        rerouted: dict[str, list[float]] = {slots: [] for slots in REROUTE_SLOTS}
        for name in args.plans:
            run = run_plan(name, Path(tmp) / f"run{len(runs)}", args.steps, profile.host_cores)
            runs.append(run)
            plan, measured = plan_from_dict(run["plan"]), run["measured_s"]
            now = replace(at_tp(plan.pipelines[0].stages[0].tp), background_procs=run["background_procs"])
            slots = run["reroute_slots"]
            est = estimate_step(now, plan, reroute_slots=slots)
            errors.append(abs(est.t_step - measured) / measured)
            if any(st.tp > 1 for p in plan.pipelines for st in p.stages):
                tp_errors.append(errors[-1])
            alone = estimate_step(replace(now, background_procs=0.0), plan, reroute_slots=slots).t_step
            quiet.append(abs(alone - measured) / measured)
            shared.append(est.cpu_share > 1)
            print(f"{name:<13} {run['procs']:>5} {est.t_step:>8.4f} {measured:>8.4f} "
                  f"{100 * (est.t_step - measured) / measured:>+6.1f}% {run['background_procs']:>5.2f} "
                  f"{run['load']:>5.2f} {100 * (alone - measured) / measured:>+6.1f}%  "
                  f"1F1B {est.shared_compute or est.compute:.4f} (alone {est.compute:.4f}) + "
                  f"{est.cpu_share:.3g} × (sync {est.sync:.4f} in {est.sync_rounds} rounds + optimizer "
                  f"{est.optimizer:.4f}) + commit {now.commit_s:.4f}", flush=True)
            if plan.reroutes:
                others = {k: estimate_step(now, plan, reroute_slots=k).t_step for k in REROUTE_SLOTS if k != slots}
                for k, t in ((slots, est.t_step), *others.items()):
                    rerouted[k].append(abs(t - measured) / measured)
                print(f"  (reroute_slots={slots} above; instead: " + ", ".join(
                    f"{k} {v:.4f} s {100 * (v - measured) / measured:+.1f}%" for k, v in others.items()) + ")")
    if args.save:
        Path(args.save).write_text(json.dumps({"profile": profile.to_dict(), "runs": runs}, indent=1))
    print(f"median |error| {100 * statistics.median(errors):.1f}% over {len(errors)} plans "
          f"(goal ≤ 10%); max {100 * max(errors):.1f}% (goal ≤ 25%)")
    print(f"  ignoring others' jobs (column quiet): median |error| {100 * statistics.median(quiet):.1f}%, "
          f"max {100 * max(quiet):.1f}%")
    if tp_errors:
        print(f"  TP plans ({len(tp_errors)}): |error| " + ", ".join(f"{100 * e:.1f}%" for e in tp_errors)
              + f" (goal ≤ 15% each; {sum(e <= 0.15 for e in tp_errors)} met)")
    if any(rerouted.values()):
        modes = sorted(REROUTE_SLOTS, key=lambda k: k != runtime_slots)
        print(f"  rerouted plans ({len(rerouted[runtime_slots])}), median |error| by reroute_slots: " + ", ".join(
            f"{k}{' (the runtime policy)' if k == runtime_slots else ''} {100 * statistics.median(rerouted[k]):.1f}%"
            for k in modes))
    for label, group in (("processes ≤ cores", False), ("processes > cores", True)):
        part = [e for e, s in zip(errors, shared) if s == group]
        if part:
            print(f"  {label}: median |error| {100 * statistics.median(part):.1f}% over {len(part)} plans")


if __name__ == "__main__":
    main()
