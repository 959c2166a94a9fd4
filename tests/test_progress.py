"""Progress bars appear only when stderr is a terminal (chameleon/report/progress.py), in every entry point."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from chameleon.report.progress import progress_bar
from tests.conftest import ENV


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stderr, wanted, shown", [(Terminal(), True, True), (Terminal(), False, False),
                                                   (io.StringIO(), True, False)])
def test_a_bar_is_shown_only_when_wanted_and_stderr_is_a_terminal(monkeypatch, stderr, wanted, shown):
    monkeypatch.setattr(sys, "stderr", stderr)
    assert list(progress_bar(range(3), desc="steps", wanted=wanted)) == [0, 1, 2]
    assert ("steps" in stderr.getvalue()) == shown


def test_simulate_into_a_pipe_writes_no_cursor_escapes(tmp_path):
    """Every policy over a trace with a fault: both bars (policies, events) would draw; stderr is a pipe."""
    cmd = [sys.executable, "-m", "chameleon.simulate", "trace=oobleck", "trace.n_removals=2", "sim.horizon_h=2",
           "sim.plots=false", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "| chameleon |" in proc.stdout
    assert "\r" not in proc.stderr and "\x1b[" not in proc.stderr, proc.stderr[:500]
