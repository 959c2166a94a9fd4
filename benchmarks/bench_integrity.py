"""What checkpoint checksums cost: write, restore and verify times with and without them.

    python benchmarks/bench_integrity.py [--repeats 3] [--json FILE] [--quick]

For the default model (``model=tiny``) and one of over 200 MB of state, the state of a
dp2 × pp2 job (fp32 parameters and both AdamW moments) is saved by its writer devices
(:class:`chameleon.runtime.checkpoint.CheckpointWriter`, each in its own thread, as in a
run), committed, then read back. Per model, the median over ``--repeats``:

- ``write_s``: every writer's save until it is on disk, and the commit; the CRC-32 of
  every tensor is part of it (computed on the writer's thread), and ``crc_s`` is that
  part alone, timed over the same tensors;
- ``restore_s`` and ``restore_unchecked_s``: every stage's regions loaded back
  (:func:`load_regions`), with the checksums, and with them removed from the
  metadata (a format-1 checkpoint, read without checks);
- ``verify_s``: :func:`verify_checkpoint`, what a resume checks before it starts
  (every file read and every tensor checked).

The files are read back from the page cache (they were just written): the figures are
the CPU's cost, not the disk's.

Then, on the default job (``python -m chameleon.train``: 4 workers, dp2 × pp2), run for
real with no fault:

- the replicas' digests: the median step time (steps 10 on) at ``ft.digest_interval``
  0 (off), 1, 10 (the default) and 100, each ÷ the time with them off;
- a corrupt gradient (``failure=corrupt``, a NaN in device 1's gradients in step 50): from
  the controller seeing the step not finite to the replay committed, against the median step.

``--quick``: the default model alone and 30-step jobs (the smoke test's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header  # noqa: E402

MODELS = {"tiny (the default)": {}, "dim 512, 8 layers": {"dim": 512, "n_layers": 8, "vocab_size": 8192}}
KINDS = ("param", "exp_avg", "exp_avg_sq")


def measure(overrides: dict, repeats: int) -> dict:
    import torch

    from chameleon.layout.geometry import writers
    from chameleon.layout.plan import even_plan
    from chameleon.layout.spec import device_holdings
    from chameleon.model.config import ModelConfig
    from chameleon.model.spec import spec_of
    from chameleon.runtime import checkpoint as ck

    model = ModelConfig(**overrides)
    spec = spec_of(model)
    shapes = spec.param_shapes(model)
    plan = even_plan(dp=2, pp=2, tp=1, n_layers=model.n_layers, global_batch=8, micro_batch=2)
    layout = spec.layout(model, plan)
    g = torch.Generator().manual_seed(0)
    full = {kind: {n: torch.randn(s, generator=g) for n, s in shapes.items()} for kind in KINDS}
    state_mb = sum(t.numel() * t.element_size() for ts in full.values() for t in ts.values()) / 1e6
    saved = writers(layout)
    needs = [device_holdings(layout)[d] for d in plan.devices]
    runs: dict[str, list[float]] = {k: [] for k in ("write_s", "crc_s", "restore_s", "restore_unchecked_s", "verify_s")}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            t0 = time.perf_counter()
            started = []
            for device, regions in saved.items():
                shards = {k: {n: full[k][n][tuple(slice(a, b) for a, b in r)] for n, r in regions.items()} for k in KINDS}
                w = ck.CheckpointWriter(root, device=device)
                w.save_async(1, shards, regions=regions, committed_steps=1)
                started.append(w)
            for w in started:
                w.wait()
            ck.commit_checkpoint(root, 1, expected_devices=saved, shapes=shapes, config={})
            runs["write_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for ts in full.values():
                for t in ts.values():
                    ck.checksum(t)
            runs["crc_s"].append(time.perf_counter() - t0)
            info = ck.latest_checkpoint(root)
            runs["restore_s"].append(_timed(lambda: [ck.load_regions(info, need) for need in needs]))
            runs["verify_s"].append(_timed(lambda: ck.verify_checkpoint(info, shapes)))
            meta_path = info.path / ck.METADATA
            meta = json.loads(meta_path.read_text())
            for entry in meta["files"].values():
                del entry["checksums"]
            meta_path.write_text(json.dumps(meta))
            runs["restore_unchecked_s"].append(_timed(lambda: [ck.load_regions(info, need) for need in needs]))
    row = {"state_mb": round(state_mb, 1), "writers": len(saved)}
    row.update({k: round(statistics.median(v), 4) for k, v in runs.items()})
    row["crc_share_of_write"] = round(row["crc_s"] / row["write_s"], 3)
    row["restore_ratio"] = round(row["restore_s"] / row["restore_unchecked_s"], 3)
    return row


def run_job(workdir: Path, *overrides: str) -> tuple[list[dict], list[dict]]:
    """The default job with ``overrides``, for real: its metrics and events."""
    import os
    import subprocess

    run_dir = workdir / f"run{len(list(workdir.iterdir()))}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", "output.progress=false",
                    "report.plots=false", *overrides], check=True, env=env, capture_output=True, cwd=workdir)
    read = [[json.loads(x) for x in (run_dir / name).read_text().splitlines()] for name in ("metrics.jsonl", "events.jsonl")]
    return read[0], read[1]


def median_step(metrics: list[dict]) -> float:
    return statistics.median(m["step_time_s"] for m in metrics if m["step"] >= 10)


def job_costs(repeats: int, *, steps: int) -> dict:
    """The digests' cost per step, and a corrupt gradient's replay, on the default job of ``steps`` steps."""
    out: dict = {"digest": {}}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for _ in range(repeats):  # interleaved, so a change of load weighs on every setting alike
            for interval in (0, 1, 10, 100):
                metrics, _ = run_job(workdir, "failure=none", f"ft.digest_interval={interval}", f"train.steps={steps}")
                out["digest"].setdefault(interval, []).append(median_step(metrics))
        metrics, events = run_job(workdir, "failure=corrupt", f"failure.step={steps // 2}", f"train.steps={steps}")
        seen = next(e["time"] for e in events if e["event"] == "not_finite")
        replayed = next(e["time"] for e in events if e["event"] == "replayed")
        out["replay_s"] = round(replayed - seen, 4)
        out["replay_step_median_s"] = round(median_step(metrics), 4)
    off = statistics.median(out["digest"][0])
    out["digest"] = {k: {"step_s": round(statistics.median(v), 5), "ratio": round(statistics.median(v) / off, 3)}
                     for k, v in out["digest"].items()}
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--quick", action="store_true", help="the default model alone, 30-step jobs")
    args = parser.parse_args()
    header("one process, the writers' threads as in a run")
    rows = {}
    print(f"{'model':<20} {'state MB':>9} {'write s':>8} {'crc s':>7} {'restore s':>10} {'unchecked s':>12} "
          f"{'ratio':>6} {'verify s':>9}")
    for name, overrides in list(MODELS.items())[:1 if args.quick else None]:
        r = rows[name] = measure(overrides, args.repeats)
        print(f"{name:<20} {r['state_mb']:>9.1f} {r['write_s']:>8.3f} {r['crc_s']:>7.3f} {r['restore_s']:>10.3f} "
              f"{r['restore_unchecked_s']:>12.3f} {r['restore_ratio']:>6.2f} {r['verify_s']:>9.3f}", flush=True)
    steps = 30 if args.quick else 100
    jobs = job_costs(args.repeats, steps=steps)
    print("\nthe default job (4 workers, dp2 × pp2), median step from step 10:")
    for interval, r in jobs["digest"].items():
        print(f"  ft.digest_interval={interval:<4} {r['step_s'] * 1e3:7.2f} ms  ÷ off {r['ratio']:.3f}")
    print(f"  a NaN gradient in step {steps // 2}: not finite → replay committed {jobs['replay_s'] * 1e3:.1f} ms "
          f"(a step: {jobs['replay_step_median_s'] * 1e3:.1f} ms)")
    if args.json:
        args.json.write_text(json.dumps({"checkpoints": rows, "job": jobs}, indent=1))


if __name__ == "__main__":
    main()
