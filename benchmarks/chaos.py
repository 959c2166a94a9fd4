"""Chaos soak: many seeds of random kills and hangs at uniformly random moments, recoveries included.

Usage::

    python benchmarks/chaos.py [--seeds 100] [--first-seed 0] [--steps 40] [--mtbf 1.5] [--quick]

Each seed trains the same job (8 workers, dp2 × pp4, checkpoints every 2 steps) with
``failure=random``: up to three faults, each a SIGKILL or a SIGSTOP of a uniformly drawn
worker, at exponentially spaced moments after training starts — wherever the victim is,
a recovery included. Every run is checked against the failure-free run of the same
layout with the oracle of ``chameleon/report/compare.py`` (same samples at every step,
losses and parameters within the measured drift between failure-free layouts), for
processes left behind, and against a wall-clock bound (a run past it is a hang). A run
that stops because every replica of a stage died before the first checkpoint must say
so in its last line. ``--quick`` (3 seeds, 4 workers, 30 steps, a fault every second) is what CI runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from chameleon.report.compare import Drift, mismatches

from _common import header
from _processes import lingering


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MODEL = ("model.dim=64", "model.n_layers=8", "train.global_batch=16", "train.micro_batch=2", "train.seq_len=32",
         "report.plots=false", "output.progress=false")
RECOVERY_PHASES = {"standby", "rebuild", "transfer", "ready"}


def train(run_dir: Path, *overrides: str, timeout: float) -> tuple[subprocess.CompletedProcess | None, int]:
    """Run one job in a session of its own; None on a timeout (the whole session is killed)."""
    cmd = [sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", *MODEL, *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=run_dir.parent, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return None, proc.pid
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), proc.pid


def outputs(run_dir: Path) -> tuple[dict, dict]:
    return (json.loads((run_dir / "summary.json").read_text()),
            torch.load(run_dir / "final_params.pt", weights_only=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mtbf", type=float, default=1.5, help="seconds between faults on average")
    parser.add_argument("--timeout", type=float, default=240.0, help="wall-clock bound per run (s)")
    parser.add_argument("--quick", action="store_true", help="3 seeds, 4 workers (dp2 × pp2), 30 steps, mtbf 1 s")
    args = parser.parse_args()
    layout = ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2") if args.quick else \
        ("launcher.nproc_per_node=8", "parallel.dp=2", "parallel.pp=4")
    others = [("parallel=dp", "launcher.nproc_per_node=1")] if args.quick else \
        [("parallel=dp", "launcher.nproc_per_node=1"), ("launcher.nproc_per_node=8", "parallel.dp=4", "parallel.pp=2"),
         ("launcher.nproc_per_node=8", "parallel=dp")]
    seeds = range(args.first_seed, args.first_seed + (3 if args.quick else args.seeds))
    steps = (f"train.steps={30 if args.quick else args.steps}",)
    mtbf = 1.0 if args.quick else args.mtbf
    header()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference, _ = train(root / "reference", *steps, *layout, "failure=none", "ckpt=none", timeout=args.timeout)
        assert reference is not None and reference.returncode == 0, reference and reference.stderr
        ref_summary, ref_params = outputs(root / "reference")
        drift = Drift()
        for i, other in enumerate(others):
            proc, _ = train(root / f"other{i}", *steps, *other, "failure=none", "ckpt=none", timeout=args.timeout)
            assert proc is not None and proc.returncode == 0, proc and proc.stderr
            d = Drift.between(*outputs(root / f"other{i}"), ref_summary, ref_params)
            drift = Drift(max(drift.loss, d.loss), max(drift.params, d.params))
        print(f"noise floor (failure-free layouts {', '.join(' '.join(o) for o in others)} vs {' '.join(layout)}): "
              f"losses {drift.loss:.1e}, parameters {drift.params:.1e} → bounds {drift.loss_tolerance:.1e} / "
              f"{drift.param_tolerance:.1e}\n", flush=True)
        tally, where, problems = collections.Counter(), collections.Counter(), []
        for seed in seeds:
            run_dir = root / f"seed{seed}"
            started = time.monotonic()
            proc, session = train(run_dir, *steps, *layout, "failure=random", "failure.kinds=[kill,hang]",
                                  f"failure.mtbf_s={mtbf}", "failure.max_faults=3", f"failure.seed={seed}",
                                  "ckpt.interval=2", timeout=args.timeout)
            wall = time.monotonic() - started
            events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()] \
                if (run_dir / "events.jsonl").exists() else []
            injected = [e for e in events if e["event"] == "injected"]
            tally["faults injected"] += len(injected)
            tally["injected during a recovery"] += sum(e["recovering"] for e in injected)
            for e in events:
                if e["event"] == "fault":
                    for position in e["where"].values():
                        if position:
                            where["recovery" if position["phase"] in RECOVERY_PHASES else position["phase"]] += 1
            if lingering(session):
                problems.append(f"seed {seed}: processes left behind")
                tally["leftovers"] += 1
            if proc is None:
                outcome = "hang"
                problems.append(f"seed {seed}: no end within {args.timeout:.0f} s")
            elif proc.returncode == 0:
                summary, params = outputs(run_dir)
                wrong = mismatches(summary, params, ref_summary, ref_params, drift=drift)
                outcome = "mismatch" if wrong else "trained"
                tally["faults survived"] += len(summary["recoveries"])
                if wrong:
                    problems.append(f"seed {seed}: {'; '.join(wrong)}")
            elif "no recovery is possible" in proc.stderr.strip().splitlines()[-1]:
                outcome = "stopped correctly"
            else:
                outcome = "failed"
                problems.append(f"seed {seed}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1]}")
            tally[outcome] += 1
            print(f"seed {seed}: {outcome} in {wall:.1f} s, {len(injected)} faults injected", flush=True)
    print("\n| seeds | faults injected | … during a recovery | faults survived | trained to the end | "
          "stopped correctly | mismatches | failed | hangs | leftovers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(seeds)} | {tally['faults injected']} | {tally['injected during a recovery']} | "
          f"{tally['faults survived']} | {tally['trained'] + tally['mismatch']} | {tally['stopped correctly']} | "
          f"{tally['mismatch']} | {tally['failed']} | {tally['hang']} | {tally['leftovers']} |")
    print("\nwhere the victims were: " + ", ".join(f"{k} {v}" for k, v in where.most_common()))
    for line in problems:
        print(f"PROBLEM {line}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
