"""Chaos soak: many seeds of random kills and hangs at uniformly random moments, recoveries included.

Usage::

    python benchmarks/chaos.py [--seeds 100] [--first-seed 0] [--steps 40] [--mtbf 1.5] [--quick]

Each seed trains the tiny model on 8 workers, checkpoints every 2 steps, in one of three
layouts taken in turn — dp2 × pp4, dp2 × pp2 × tp2 and dp2 × tp4 (its model with 8 heads, 4 KV) —
with ``failure=random``: up to three faults, each a SIGKILL or a SIGSTOP of a uniformly drawn
worker, at exponentially spaced moments after training starts — wherever the victim is, a
recovery included. With TP, two faults often break every replica of a stage while each of its
shards lives on somewhere: the stage is rebuilt from the shards of different replicas.
Every run is checked against the failure-free run of its layout with the oracle of
``chameleon/report/compare.py`` (same samples at every step, losses and parameters
within the measured drift between its failure-free run and those of other layouts of its
TP size, which its recoveries may reach), for processes left behind, and
against a wall-clock bound (a run past it is a hang). A run that stops because some
region of the state lost its every holder before the first checkpoint must say so in its
last line. ``--quick`` (3 seeds on 4 workers, dp2 × pp2 and dp2 × tp2, 30 steps, a fault every
second) is what CI runs.
"""

from __future__ import annotations

import argparse
import collections
import itertools
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


def layout(nproc: int, dp: int, pp: int, tp: int = 1) -> tuple[str, ...]:
    """The overrides of a layout; TP 4 needs 4 KV heads (the model has 2 otherwise), and 8 query heads: with 4 the
    model trains chaotically enough that failure-free layouts drift 1e-2 apart in 40 steps, a useless noise floor."""
    heads = ("model.n_heads=8", "model.n_kv_heads=4") if tp == 4 else ()
    return (f"launcher.nproc_per_node={nproc}", f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}", *heads)


# Each seed's layout, and failure-free layouts of its TP size (re-plans keep TP groups whole) that its recoveries
# may reach: the drift between those and its own failure-free run is its noise floor.
LAYOUTS = {
    "dp2×pp4": (layout(8, 2, 4), [layout(1, 1, 1), layout(8, 4, 2), layout(8, 8, 1)]),
    "dp2×pp2×tp2": (layout(8, 2, 2, 2), [layout(2, 1, 1, 2), layout(8, 4, 1, 2), layout(8, 1, 4, 2)]),
    "dp2×tp4": (layout(8, 2, 1, 4), [layout(4, 1, 1, 4), layout(8, 1, 2, 4)]),
}
QUICK_LAYOUTS = {
    "dp2×pp2": (layout(4, 2, 2), [layout(1, 1, 1)]),
    "dp2×tp2": (layout(4, 2, 1, 2), [layout(2, 1, 1, 2)]),
}
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


def rebuilt_from_shards(decision: dict) -> bool:
    """Every replica of some stage lost a device (no peer to reroute to), yet it recovered in memory: from the
    shards of several replicas (with TP 1 a stage without a live replica is lost, and only a checkpoint helps)."""
    reroute = next(c for c in decision["candidates"] if c["name"] == "reroute")
    return decision["choice"] in ("dynamic", "redundant") and "no surviving same-stage peer" in reroute["why"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mtbf", type=float, default=1.5, help="seconds between faults on average")
    parser.add_argument("--timeout", type=float, default=240.0, help="wall-clock bound per run (s)")
    parser.add_argument("--quick", action="store_true",
                        help="3 seeds, 4 workers (dp2 × pp2, dp2 × tp2), 30 steps, mtbf 1 s")
    args = parser.parse_args()
    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS
    seeds = range(args.first_seed, args.first_seed + (3 if args.quick else args.seeds))
    steps = (f"train.steps={30 if args.quick else args.steps}",)
    mtbf = 1.0 if args.quick else args.mtbf
    header()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = itertools.count()

        def failure_free(overrides: tuple[str, ...]) -> tuple[dict, dict]:
            run_dir = root / f"failure-free{next(runs)}"
            proc, _ = train(run_dir, *steps, *overrides, "failure=none", "ckpt=none", timeout=args.timeout)
            assert proc is not None and proc.returncode == 0, proc and proc.stderr
            return outputs(run_dir)

        references, floors = {}, {}
        for name, (overrides, others) in layouts.items():
            references[name] = failure_free(overrides)
            drifts = [Drift.between(*failure_free(other), *references[name]) for other in others]
            floors[name] = Drift(max(d.loss for d in drifts), max(d.params for d in drifts))
            print(f"noise floor of {name} (its failure-free run vs {'; '.join(' '.join(o) for o in others)}): "
                  f"losses {floors[name].loss:.1e}, parameters {floors[name].params:.1e} → bounds "
                  f"{floors[name].loss_tolerance:.1e} / {floors[name].param_tolerance:.1e}", flush=True)
        print()
        tally, where, problems = collections.Counter(), collections.Counter(), []
        by_layout: dict[str, collections.Counter] = {name: collections.Counter() for name in layouts}
        for seed in seeds:
            name = list(layouts)[seed % len(layouts)]
            (overrides, _), (ref_summary, ref_params) = layouts[name], references[name]
            run_dir = root / f"seed{seed}"
            started = time.monotonic()
            proc, session = train(run_dir, *steps, *overrides, "failure=random", "failure.kinds=[kill,hang]",
                                  f"failure.mtbf_s={mtbf}", "failure.max_faults=3", f"failure.seed={seed}",
                                  "ckpt.interval=2", timeout=args.timeout)
            wall = time.monotonic() - started
            events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()] \
                if (run_dir / "events.jsonl").exists() else []
            injected = [e for e in events if e["event"] == "injected"]
            seen = collections.Counter({"seeds": 1, "faults injected": len(injected),
                                        "injected during a recovery": sum(e["recovering"] for e in injected)})
            for e in events:
                if e["event"] == "fault":
                    seen["rebuilt from shards"] += rebuilt_from_shards(e["decision"])
                    for position in e["where"].values():
                        if position:
                            where["recovery" if position["phase"] in RECOVERY_PHASES else position["phase"]] += 1
            if lingering(session):
                problems.append(f"seed {seed}: processes left behind")
                seen["leftovers"] += 1
            if proc is None:
                outcome = "hang"
                problems.append(f"seed {seed}: no end within {args.timeout:.0f} s")
            elif proc.returncode == 0:
                summary, params = outputs(run_dir)
                wrong = mismatches(summary, params, ref_summary, ref_params, drift=floors[name])
                outcome = "mismatch" if wrong else "trained"
                seen["faults survived"] += len(summary["recoveries"])
                if wrong:
                    problems.append(f"seed {seed}: {'; '.join(wrong)}")
            elif "no recovery is possible" in proc.stderr.strip().splitlines()[-1]:
                outcome = "stopped correctly"
            else:
                outcome = "failed"
                problems.append(f"seed {seed}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1]}")
            seen[outcome] += 1
            tally.update(seen)
            by_layout[name].update(seen)
            print(f"seed {seed} ({name}): {outcome} in {wall:.1f} s, {len(injected)} faults injected", flush=True)
    print("\n| seeds | faults injected | … during a recovery | faults survived | trained to the end | "
          "stopped correctly | mismatches | failed | hangs | leftovers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(seeds)} | {tally['faults injected']} | {tally['injected during a recovery']} | "
          f"{tally['faults survived']} | {tally['trained'] + tally['mismatch']} | {tally['stopped correctly']} | "
          f"{tally['mismatch']} | {tally['failed']} | {tally['hang']} | {tally['leftovers']} |")
    print("\n| layout | seeds | faults injected | faults survived | … stages rebuilt from shards of several replicas | "
          "trained to the end | stopped correctly | mismatches | failed | hangs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, t in by_layout.items():
        print(f"| {name} | {t['seeds']} | {t['faults injected']} | {t['faults survived']} | {t['rebuilt from shards']} | "
              f"{t['trained'] + t['mismatch']} | {t['stopped correctly']} | {t['mismatch']} | {t['failed']} | {t['hang']} |")
    print("\nwhere the victims were: " + ", ".join(f"{k} {v}" for k, v in where.most_common()))
    for line in problems:
        print(f"PROBLEM {line}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
