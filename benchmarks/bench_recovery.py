"""Kill → first committed post-recovery step, per policy, side by side with a restart path.

Usage::

    python benchmarks/bench_recovery.py [--workers 4 8] [--steps 30] [--kill-step 15]

For each worker count it runs the same job (the tiny model; 4 workers: 2 pipelines ×
2 stages, 8 workers: 2 × 4) once per forced policy and once under Chameleon's own
choice, SIGKILLing worker 1 at a random moment of step ``kill-step``. It reads each
run's recovery breakdown (detect, decide, restore = group rebuild + transfer, redo
of the abandoned step), the throughput before and after, and the time from the fault
to the last committed step. The restart path is measured in the same session the way
torchrun recovers: the job stops every worker on the fault (``ft.on_fault=exit``)
and is relaunched at once from its newest checkpoint (``ckpt.resume``); its figure is
the time from the kill to the relaunched job's first committed step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import header


POLICIES = ("reroute", "dynamic", "redundant", "checkpoint", "chameleon")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def layout(workers: int) -> list[str]:
    pp = workers // 2
    return [f"launcher.nproc_per_node={workers}", "parallel.dp=2", f"parallel.pp={pp}", f"model.n_layers={max(4, 2 * pp)}"]


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", "output.progress=false", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=run_dir.parent, timeout=600)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def policy_run(root: Path, workers: int, policy: str, common: list[str]) -> dict:
    run_dir = root / f"w{workers}-{policy}"
    proc = train(run_dir, *common, *layout(workers), f"policy.name={policy}")
    if proc.returncode != 0:
        raise RuntimeError(f"{policy} on {workers} workers failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rec = summary["recoveries"][0]
    fault = next(e for e in lines(run_dir / "events.jsonl") if e["event"] == "fault")
    return {
        "policy": policy, "chosen": rec["chosen"], "total_s": rec["total_s"], "detect_s": rec["detect_s"],
        "decide_s": rec["decide_s"], "restore_s": rec["restore_s"], "redo_s": rec["redo_s"],
        "manifest_mb": rec["manifest_bytes"] / 1e6, "before": summary["samples_per_s_before_fault"],
        "after": summary["samples_per_s_after_recovery"],
        "post_fault_train_s": lines(run_dir / "metrics.jsonl")[-1]["time"] - fault["t_fault"],
    }


def restart_run(root: Path, workers: int, common: list[str]) -> dict:
    first, second = root / f"w{workers}-restart-a", root / f"w{workers}-restart-b"
    proc = train(first, *common, *layout(workers), "ft.on_fault=exit")
    if proc.returncode != 3:
        raise RuntimeError(f"the restart path's first job did not stop on the fault:\n{proc.stderr[-3000:]}")
    fault = next(e for e in lines(first / "events.jsonl") if e["event"] == "fault")
    relaunched = time.time()
    proc = train(second, *common, *layout(workers), "failure=none", f"ckpt.resume={first / 'checkpoints'}")
    if proc.returncode != 0:
        raise RuntimeError(f"the relaunch failed:\n{proc.stderr[-3000:]}")
    first_commit = lines(second / "metrics.jsonl")[0]
    return {
        "total_s": first_commit["time"] - fault["t_fault"], "relaunch_to_first_step_s": first_commit["time"] - relaunched,
        "stop_s": relaunched - fault["t_fault"], "resumed_at": json.loads((second / "summary.json").read_text())["first_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=15)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--quick", action="store_true", help="4 workers, 10 steps, Chameleon's own choice only")
    args = parser.parse_args()
    if args.quick:
        args.workers, args.steps, args.kill_step, args.policies = [4], 12, 8, ["chameleon"]
    header()
    common = [f"train.steps={args.steps}", "failure=kill", "failure.rank=1", f"failure.step={args.kill_step}",
              "failure.phase=any", "ckpt.interval=5"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for workers in args.workers:
            rows = [policy_run(root, workers, p, common) for p in args.policies]
            restart = restart_run(root, workers, common)
            print(f"\n## {workers} workers ({' '.join(layout(workers))}), kill of worker 1 in step {args.kill_step}")
            print("| policy | kill → first committed step (s) | detect | decide | restore | redo | ÷ restart | "
                  "samples/s before → after | fault → end (s) |")
            print("|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                name = r["policy"] if r["policy"] != "chameleon" else f"chameleon (chose {r['chosen']})"
                print(f"| {name} | {r['total_s']:.3f} | {r['detect_s']:.3f} | {r['decide_s']:.3f} | {r['restore_s']:.3f} | "
                      f"{r['redo_s']:.3f} | {r['total_s'] / restart['total_s']:.3f} | {r['before']:.0f} → {r['after']:.0f} | "
                      f"{r['post_fault_train_s']:.2f} |")
            print(f"| restart path (stop all, relaunch, reload step {restart['resumed_at']}) | {restart['total_s']:.3f} | "
                  f"— | — | — | — | 1.000 | — | — |")
            forced = [r for r in rows if r["policy"] != "chameleon"]
            chosen = next((r["chosen"] for r in rows if r["policy"] == "chameleon"), None)
            if forced and chosen:
                best = min(forced, key=lambda r: r["post_fault_train_s"])
                print(f"\nselector chose {chosen}; best in hindsight (least time from the fault to the last step): "
                      f"{best['policy']}")
            print(f"median kill → first committed step over in-memory policies: "
                  f"{statistics.median(r['total_s'] for r in rows if r['policy'] != 'checkpoint') if rows else 0:.3f} s; "
                  f"max decision {max(r['decide_s'] for r in rows) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
