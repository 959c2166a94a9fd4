"""How far runs drift from their failure-free run, fp32 and bf16: where the fault tests' tolerances come from.

    python benchmarks/bench_precision.py [--quick]

The fault tests' model (6 layers, dim 64, 8 steps, clipping at 0.5, warm-up +
cosine) on dp2 × pp3: for each precision, the failure-free run, then runs that
change how the math is grouped — a single process, tensor parallelism, and a kill
recovered by each policy — each compared with the failure-free run of its precision:
the largest per-step loss difference (relative), whether all losses are bitwise
equal, and the largest per-tensor parameter difference ‖a − b‖/‖b‖. The mean step
time of the failure-free runs compares the precisions on this machine.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
MODEL = ("train.steps=8", "model.dim=64", "model.n_layers=6", "train.global_batch=12", "train.micro_batch=2",
         "train.seq_len=32", "ft.heartbeat_timeout_s=3.0", "ckpt=none", "parallel=dp", "train.clip_norm=0.5",
         "train.lr_schedule=cosine", "train.warmup_steps=2", "output.progress=false")
DP2_PP3 = ("launcher.nproc_per_node=6", "parallel.dp=2", "parallel.pp=3")
VARIANTS = {
    "single process": ("launcher.nproc_per_node=1", "failure=none"),
    "dp2 × tp2 (TP all-reduces)": ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.tp=2",
                                   "failure=none"),
    "kill → reroute": (*DP2_PP3, "policy.name=reroute", "failure=kill", "failure.rank=5", "failure.step=3",
                       "failure.phase=sync"),
    "kill → dynamic": (*DP2_PP3, "policy.name=dynamic", "failure=kill", "failure.rank=1", "failure.step=3",
                       "failure.phase=backward"),
    "kill → redundant": (*DP2_PP3, "policy.name=redundant", "failure=kill", "failure.rank=4", "failure.step=3",
                         "failure.phase=sync"),
}


def train(run_dir: Path, *overrides: str) -> tuple[dict, dict[str, torch.Tensor], list[float]]:
    proc = subprocess.run([sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", *MODEL, *overrides],
                          cwd=run_dir.parent, env=ENV, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"run {overrides} failed:\n{proc.stderr[-3000:]}")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, torch.load(run_dir / "final_params.pt", weights_only=True), [m["step_time_s"] for m in metrics]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bf16 only, against a single process")
    args = parser.parse_args()
    dtypes, variants = (("bf16",), ["single process"]) if args.quick else (("fp32", "bf16"), list(VARIANTS))
    header()
    print(f"model: {' '.join(MODEL)}\nreference: each precision's failure-free run on {' '.join(DP2_PP3)}\n", flush=True)
    rows, step_times = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            ref, ref_params, times = train(Path(tmp) / f"{dtype}-ref", *DP2_PP3, "failure=none", f"train.dtype={dtype}")
            step_times[dtype] = statistics.median(times[1:])
            for name in variants:
                got, params, _ = train(Path(tmp) / f"{dtype}-{len(rows)}", *VARIANTS[name], f"train.dtype={dtype}")
                loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"], strict=True))
                param = max(((params[n] - t).norm() / t.norm()).item() for n, t in ref_params.items())
                rows.append((dtype, name, loss, got["losses"] == ref["losses"], param))
    print(f"{'dtype':<6} {'run':<28} {'max loss diff (rel)':>20} {'losses bitwise':>15} {'max param diff (rel)':>21}")
    for dtype, name, loss, same, param in rows:
        print(f"{dtype:<6} {name:<28} {loss:>20.2e} {'yes' if same else 'no':>15} {param:>21.2e}")
    if len(step_times) == 2:
        print(f"\nmedian step time, failure-free dp2 × pp3: fp32 {step_times['fp32'] * 1e3:.0f} ms, "
              f"bf16 {step_times['bf16'] * 1e3:.0f} ms (bf16/fp32 {step_times['bf16'] / step_times['fp32']:.2f})")


if __name__ == "__main__":
    main()
