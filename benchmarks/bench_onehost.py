"""One host, two revisions side by side: did the multi-node runtime cost single-host jobs anything?

Usage::

    python benchmarks/bench_onehost.py [--baseline 3691239] [--repeats 3] [--quick]

Runs the same job — the tiny model on 4 workers (dp2 × pp2), 30 steps, worker 1 SIGKILLed
in the backward of step 15, re-planned (``policy.name=dynamic``), checkpoints every 5 steps —
with this tree and with ``--baseline`` (checked out into a temporary git worktree),
alternating, ``--repeats`` times each. The current tree trains the baseline's math
(no clipping, a constant learning rate), so both reach the same losses. Reported: medians of
the start-up (launch → first step), the steady step rate before the fault, kill → first
committed step, and the rate after the recovery, with their ratios, and the median time a failure-free step takes beyond its slowest worker's compute
(``step_time_s − compute_s``: the commit round trip, the optimizer step, the wait for the next step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import header


ROOT = Path(__file__).resolve().parent.parent
JOB = ["train.steps=30", "model.dim=64", "model.n_layers=4", "train.global_batch=16", "train.micro_batch=4",
       "parallel.dp=2", "parallel.pp=2", "failure=kill", "failure.rank=1", "failure.step=15", "failure.phase=backward",
       "policy.name=dynamic", "ckpt.interval=5", "output.progress=false"]
CURRENT_ONLY = ["launcher.nproc_per_node=4", "train.clip_norm=0", "train.lr_schedule=constant", "train.warmup_steps=0",
                "report.plots=false"]


def run(tree: Path, run_dir: Path) -> dict:
    current = "nproc_per_node" in (tree / "conf" / "launcher" / "local.yaml").read_text()
    cmd = [sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", *JOB,
           *(CURRENT_ONLY if current else ["launcher.nproc=4"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir.parent, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    before = [m for m in steps if 0 < m["step"] < recovery["step"]]
    return {"startup_s": summary["startup_s"], "before": summary["samples_per_s_before_fault"],
            "recovery_s": recovery["total_s"], "after": summary["samples_per_s_after_recovery"],
            "beyond_ms": 1e3 * statistics.median(m["step_time_s"] - m["compute_s"] for m in before),
            "final_loss": summary["final_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="3691239", help="the git revision to compare with (default: the last "
                        "before the push control plane)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    header()
    with tempfile.TemporaryDirectory() as tmp:
        baseline = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline), args.baseline],
                       check=True, capture_output=True)
        try:
            trees = {f"baseline {args.baseline}": baseline, "this tree": ROOT}
            results = {name: [] for name in trees}
            for i in range(repeats):
                for name, tree in trees.items():
                    results[name].append(run(tree, Path(tmp) / f"{name.split()[0]}{i}"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=True)
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in results.items()}
    base, this = med[f"baseline {args.baseline}"], med["this tree"]
    print("\n| tree | start-up (s) | samples/s before the fault | step beyond its compute (ms) | "
          "kill → first committed step (s) | samples/s after | final loss |")
    print("|---|---|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['startup_s']:.2f} | {m['before']:.0f} | {m['beyond_ms']:.1f} | {m['recovery_s']:.3f} | "
              f"{m['after']:.0f} | {m['final_loss']:.6f} |")
    print(f"| this ÷ baseline | {this['startup_s'] / base['startup_s']:.2f} | {this['before'] / base['before']:.2f} | "
          f"{this['beyond_ms'] / base['beyond_ms']:.2f} | {this['recovery_s'] / base['recovery_s']:.2f} | "
          f"{this['after'] / base['after']:.2f} | — |")
    print(f"\nmedians of {repeats} alternating runs each")


if __name__ == "__main__":
    main()
