"""A whole node lost and regained: three loopback nodes of two workers, in one run.

Usage::

    python benchmarks/bench_multinode.py [--steps 600] [--kill-step 20] [--repeats 2] [--quick] [--keep DIR]

The job (the tiny model, three pipelines of two stages, one per node) loses node 1 — its
agent and both workers SIGKILLed as one process group at a random moment of step
``--kill-step`` — and gets it back: the node's agent is started again with the same
command as soon as it died, as a repaired host would be. Reported, per repeat:

- node kill → first committed step, with detect, decide, restore and redo as in docs/recovery.md;
- the node's agent registering again → first committed step on the grown plan;
- throughput before the fault, between the fault and the re-join, and after the re-join.

Goals: node kill → first committed step ≤ 1 s; re-join → grown plan ≤ 2 s after the
agent registers; throughput after the re-join within 5 % of before the fault.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header  # noqa: E402
from _loopback import Loopback  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
JOB = ["model.dim=64", "model.n_layers=4", "train.global_batch=12", "train.micro_batch=2", "train.seq_len=32",
       "launcher.nproc_per_node=2", "parallel.dp=3", "parallel.pp=2", "ckpt=none", "report.plots=false",
       "output.progress=false", "output.save_params=false"]
SKIP = 3  # steps after each transition left out of the throughput windows


def one_run(workdir: Path, steps: int, kill_step: int) -> dict:
    job = [*JOB, f"train.steps={steps}", "failure=node_kill", "failure.node=1", f"failure.step={kill_step}",
           "failure.phase=any", "policy.name=dynamic"]
    cluster = Loopback(workdir, job, env=ENV)
    run_dir = workdir / "node0"

    def node0(common: list[str], env: dict) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", *common]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir, timeout=600)

    proc = cluster.run(node0, restart=1)
    if proc.returncode != 0:
        raise RuntimeError(f"the job failed:\n{proc.stderr[-3000:]}")
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recovered = next(e for e in events if e["event"] == "recovered")
    returned = next(e for e in events if e["event"] == "node_returned")
    grown = [e for e in events if e["event"] == "grown"]
    if not grown:
        decline = next((e for e in events if e["event"] == "growth"), {})
        raise RuntimeError(f"the job never grew back onto node 1: {decline.get('decision', 'no decision')}")
    switch = min(m["step"] for m in metrics if m["time"] >= grown[0]["time"] - grown[0]["first_step_s"] - 1e-3)

    def rate(lo: int, hi: int) -> float:
        window = [m for m in metrics if lo <= m["step"] < hi]
        return sum(m["samples_per_s"] * m["step_time_s"] for m in window) / sum(m["step_time_s"] for m in window)

    return {
        "kill": recovered, "chosen": recovered["chosen"], "growth": grown[-1],
        "rejoin_s": grown[-1]["time"] - returned["time"], "growths": len(grown),
        "before": rate(SKIP, recovered["step"]), "degraded": rate(recovered["step"] + SKIP, switch),
        "after": rate(switch + SKIP, steps), "plan": json.loads((run_dir / "summary.json").read_text())["plan"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one repeat of 400 steps")
    parser.add_argument("--keep", type=Path, help="run in DIR and keep every node's logs and run dir there")
    args = parser.parse_args()
    steps, repeats = (400, 1) if args.quick else (args.steps, args.repeats)
    header("3 loopback nodes × 2 workers, gloo")
    rows = []
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            workdir = Path(tmp) / f"run{i}"
            workdir.mkdir(parents=True)
            rows.append(one_run(workdir, steps, args.kill_step))
    print("\n| repeat | node kill → first committed step (s) | detect | decide | restore | redo | chose | "
          "re-join: registered → grown plan's first commit (s) | samples/s before → after the fault → after the re-join |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        k = r["kill"]
        print(f"| {i} | {k['total_s']:.3f} | {k['detect_s']:.3f} | {k['decide_s']:.3f} | {k['restore_s']:.3f} | "
              f"{k['redo_s']:.3f} | {r['chosen']} | {r['rejoin_s']:.3f} ({r['growths']} growth{'s' * (r['growths'] > 1)}) | "
              f"{r['before']:.0f} → {r['degraded']:.0f} → {r['after']:.0f} |")
    kill = statistics.median(r["kill"]["total_s"] for r in rows)
    rejoin = statistics.median(r["rejoin_s"] for r in rows)
    ratio = statistics.median(r["after"] / r["before"] for r in rows)
    print(f"\nmedians: node kill → first committed step {kill:.3f} s (goal ≤ 1 s: {'met' if kill <= 1 else 'missed'}); "
          f"re-join → grown plan {rejoin:.3f} s (goal ≤ 2 s: {'met' if rejoin <= 2 else 'missed'}); "
          f"throughput after the re-join ÷ before the fault {ratio:.3f} (goal ≥ 0.95: {'met' if ratio >= 0.95 else 'missed'})")
    g = rows[-1]["growth"]
    print(f"last re-join, from its devices' return: decide {g['decide_s']:.3f} s, wait for a step boundary "
          f"{g['switch_wait_s']:.3f} s, restore {g['restore_s']:.3f} s, first step {g['first_step_s']:.3f} s")
    print(f"final plan of the last repeat:\n{rows[-1]['plan']}")


if __name__ == "__main__":
    main()
