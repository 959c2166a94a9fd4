"""Check Chameleon on whatever accelerators this host has, in a few minutes, and print one table.

    python benchmarks/device_check.py

1. The accelerator-marked tests (``pytest -m accelerator``): state resident on the
   device and stepping like the CPU, workers sharing one GPU over gloo recovering a
   kill (fp32 and bf16), and, with two or more GPUs, NCCL workers recovering a kill.
2. A recovery run of the default model: one GPU → four workers (2 pipelines × 2
   stages) on ``cuda:0`` over gloo in bf16; two or more → one worker per GPU (up to
   four, data parallel) over NCCL in bf16.
   The same run on the CPU (gloo, bf16) is the baseline beside it.

On a host without an accelerator the CPU baseline still runs, and every accelerator
row says it was skipped and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
RUN = ("train.steps=30", "train.dtype=bf16", "failure=kill", "failure.rank=1", "failure.step=15",
       "failure.phase=backward", "ckpt=none", "output.progress=false")


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_tests() -> tuple[str, float, str]:
    """``pytest -m accelerator``: its outcome line."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "accelerator", "-rs", "tests/test_accelerator.py"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    lines = proc.stdout.strip().splitlines()
    outcome = lines[-1] if lines else proc.stderr.strip()[-200:]
    status = "FAILED" if proc.returncode != 0 else "ok" if " passed" in outcome else "skipped"
    skipped = "; ".join(sorted({line.split(": ", 1)[-1] for line in lines if line.startswith("SKIPPED")}))
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    return status, time.perf_counter() - t0, outcome + (f" (skipped: {skipped})" if skipped else "")


def recovery_run(name: str, overrides: tuple[str, ...]) -> tuple[str, float, str]:
    """A default-model run with one kill: its recovery and throughput."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", *RUN, *overrides],
                              cwd=tmp, env=ENV, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"--- {name} ---\n{proc.stderr[-4000:]}", file=sys.stderr)
            return "FAILED", wall, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        summary = json.loads((run_dir / "summary.json").read_text())
    (rec,) = summary["recoveries"]
    return "ok", wall, (f"{rec['chosen']} in {rec['total_s']:.3f} s; {summary['samples_per_s']:.1f} samples/s; "
                        f"final loss {summary['final_loss']:.4f}")


def main() -> None:
    header()
    n = gpus()
    print(f"accelerators: {n} CUDA device(s)" + (f" ({torch.cuda.get_device_name(0)})" if n else ""), flush=True)
    rows = [("CPU, 4 workers, gloo, bf16 (baseline)",
             recovery_run("cpu", ("launcher.device=cpu", "launcher.nproc_per_node=4")))]
    rows.append(("pytest -m accelerator", run_tests()))
    if n == 0:
        rows.append(("recovery run on the accelerator", ("skipped", 0.0, "no CUDA device visible")))
    else:
        if n == 1:
            rows.append(("cuda:0, 4 workers, gloo, bf16", recovery_run(
                "gpu", ("launcher.device=cuda", "launcher.backend=gloo", "launcher.nproc_per_node=4"))))
        else:
            workers = min(n, 4)  # NCCL runs data-parallel plans (pipelines over NCCL are refused for now)
            rows.append((f"{workers} GPUs, NCCL, bf16, data parallel", recovery_run(
                "gpu", ("launcher.device=cuda", f"launcher.nproc_per_node={workers}", "parallel=dp"))))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check'.ljust(width)}  result   wall s  detail")
    for name, (status, wall, detail) in rows:
        print(f"{name.ljust(width)}  {status:<7} {wall:7.1f}  {detail}")
    sys.exit(1 if any(r[1][0] == "FAILED" for r in rows) else 0)


if __name__ == "__main__":
    main()
