"""Each figure-producing benchmark's quick mode runs end to end, so none can rot (figures not checked here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENV

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**ENV, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def test_paper_evaluation_quick_writes_the_whole_page(tmp_path):
    proc = run("paper_evaluation.py", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "evaluation.md").read_text()
    for heading in ("## The paper's three headline claims", "## Oobleck's traces", "with repairs", "Llama 3", "## Scale benchmark"):
        assert heading in page
    assert "{" not in page.replace("{'", "")  # every placeholder filled
    assert (tmp_path / "eval_throughput_30min.png").stat().st_size > 0


def test_bench_simulator_quick():
    proc = run("bench_simulator.py", "--quick")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "**chameleon:" in proc.stdout and "faults handled" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason="torchft is not installed: pip install -e '.[peers]' (torchft==0.2.0) to run bench_torchft")
def test_bench_torchft_quick(tmp_path):
    proc = run("bench_torchft.py", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "torchft.md").read_text()
    assert "| chameleon |" in page and "| torchft |" in page


def test_chaos_quick():
    """Three seeds of random kills and hangs: nothing lost, nothing hung, nothing left behind."""
    proc = run("chaos.py", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 3 |" in proc.stdout and "PROBLEM" not in proc.stdout


@pytest.mark.parametrize(("script", "args", "expect"), [
    ("bench_recovery.py", ["--quick"], "restart path"),
    ("bench_pipeline.py", ["--layouts", "2x2", "--rounds", "1", "--warmup", "1", "--steps", "2"], "ours/plain"),
    ("bench_sync.py", ["--plans", "2+3", "--dims", "64", "--rounds", "1", "--warmup", "1", "--iters", "2"], "round"),
    ("bench_planner.py", ["--scales", "32"], "32"),
    ("bench_estimator.py", ["--plans", "dp2", "--steps", "3"], "dp2"),
    ("bench_precision.py", ["--quick"], "single process"),
    ("device_check.py", [], "skipped"),
    ("bench_multinode.py", ["--quick"], "medians"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_runtime_benchmark_runs(script, args, expect):
    """A smallest run of each runtime benchmark (its full run writes the docs' figures)."""
    proc = run(script, *args, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert expect in proc.stdout


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="compares with an earlier git revision: needs a git checkout")
def test_bench_onehost_quick():
    proc = run("bench_onehost.py", "--quick", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "this ÷ baseline" in proc.stdout
