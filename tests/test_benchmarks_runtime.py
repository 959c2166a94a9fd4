"""The runtime benchmarks' smallest runs end to end, so none can rot (figures not checked here)."""

from __future__ import annotations

import pytest

from tests.test_benchmarks import ROOT, run

pytestmark = pytest.mark.full  # the benchmarks' smoke runs belong to the full suite


def test_chaos_quick():
    """Three seeds of random kills and hangs: nothing lost, nothing hung, nothing left behind."""
    proc = run("chaos.py", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 3 |" in proc.stdout and "PROBLEM" not in proc.stdout


@pytest.mark.parametrize(("script", "args", "expect"), [
    ("bench_recovery.py", ["--quick"], "restart path"),
    ("bench_step.py", ["--layouts", "2x1x2", "--n-layers", "4", "--dim", "64", "--rounds", "1", "--warmup", "1",
                       "--steps", "2"], "ratio = Chameleon's tokens/s"),
    ("bench_sync.py", ["--plans", "2+3", "--dims", "64", "--rounds", "1", "--warmup", "1", "--iters", "2"], "round"),
    ("bench_wait.py", ["--rounds", "1", "--iters", "5"], "handoff ÷ sliced"),
    ("bench_planner.py", ["--scales", "32"], "32"),
    ("bench_decision.py", ["--devices", "48"], "| 48 |"),
    ("bench_estimator.py", ["--plans", "dp2", "--steps", "3"], "dp2"),
    ("bench_precision.py", ["--quick"], "single process"),
    ("device_check.py", [], "needs a CUDA device and none is visible"),
    ("bench_memory.py", ["--dim", "64", "--n-layers", "2", "--seq-len", "32", "--vocab", "256", "--steps", "1"],
     "saving vs none"),
    ("bench_relayout_memory.py", ["--dim", "64", "--n-layers", "2", "--vocab", "256"], "measured ÷ estimate"),
    ("bench_multinode.py", ["--quick"], "medians"),
    ("bench_groups.py", ["--ranks", "2", "4"], "plan"),
    ("bench_slow.py", ["--quick"], "chameleon ÷ best"),
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
