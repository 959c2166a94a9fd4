"""Each figure-producing benchmark's quick mode runs end to end, so none can rot (figures not checked here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENV

pytestmark = pytest.mark.full  # the benchmarks' smoke runs belong to the full suite

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


def test_bench_sim_slow_quick():
    proc = run("bench_sim_slow.py", "--quick")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| chameleon |" in proc.stdout and "| failstop |" in proc.stdout and "goal (chameleon ahead" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason="torchft is not installed: pip install -e '.[peers]' (torchft==0.2.0) to run bench_torchft")
def test_bench_torchft_quick(tmp_path):
    proc = run("bench_torchft.py", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "torchft.md").read_text()
    assert "| chameleon |" in page and "| torchft |" in page



def test_bench_data_small(tmp_path):
    proc = run("bench_data.py", "--mb", "0.5", "--vocab", "512", "--big-gb", "0.01", "--steps", "3", "--repeats", "1",
               "--json", str(tmp_path / "data.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shards byte-identical across worker counts: yes" in proc.stdout and "stream ratio" in proc.stdout


def test_bench_integrity_quick(tmp_path):
    proc = run("bench_integrity.py", "--quick", "--repeats", "1", "--json", str(tmp_path / "integrity.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiny (the default)" in proc.stdout and "ft.digest_interval=10" in proc.stdout and "replay committed" in proc.stdout
