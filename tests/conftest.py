"""Shared helpers: run ``python -m chameleon.<entry>`` as a real subprocess and read its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def leftover_workers(self) -> list[int]:
        """Worker processes of this run that are still alive (there must be none)."""
        start = json.loads((self.run_dir / "events.jsonl").read_text().splitlines()[0])
        return [pid for pid in start["workers"].values() if _alive(pid)]

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / "final_params.pt", weights_only=True)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def run_entry(entry: str, run_dir: Path, *overrides: str, timeout: float = 240) -> Run:
    """Run ``python -m chameleon.<entry>`` with Hydra overrides, its run dir pinned to ``run_dir``."""
    cmd = [sys.executable, "-m", f"chameleon.{entry}", f"hydra.run.dir={run_dir}", "output.progress=false", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=run_dir.parent)
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir)


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor ``‖a − b‖ / ‖b‖`` over the union of names (missing names fail)."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Run:
    """The single-process reference every multi-worker run is compared with."""
    run = run_entry("train", tmp_path_factory.mktemp("ref") / "run", *SMALL_RUN, "launcher.nproc_per_node=1")
    assert run.returncode == 0, run.stderr
    return run


# A short run of the tiny model; every layout test trains exactly these steps.
SMALL_RUN = (
    "train.steps=6", "model.dim=64", "model.n_layers=4", "train.global_batch=8", "train.micro_batch=2",
    "train.seq_len=32", "failure=none", "parallel=dp",
)
