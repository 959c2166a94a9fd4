"""Shared helpers: run ``python -m chameleon.<entry>`` as a real subprocess and read its outputs; the two tiers.

``python -m pytest -q`` is the fast tier: every unit and property test and a few end-to-end runs (a fault
recovery decided by Eq. 8, a whole node lost over three loopback hosts, Ctrl-C, each way a start can fail).
Tests marked ``full`` — every other end-to-end run, cluster and signal test, and the benchmarks' smoke runs —
are deselected unless ``--full`` is given: ``python -m pytest -q --full`` is the full suite, what CI runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from benchmarks._loopback import free_port_pair
from benchmarks._processes import lingering
from chameleon.report.compare import Drift, mismatches

_FULL_LEFT_OUT = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", help="the full suite: also the tests marked full (see conftest.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``--full``, deselect the tests marked ``full`` (pytest counts them as deselected)."""
    if config.getoption("--full"):
        return
    full = [item for item in items if item.get_closest_marker("full")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker("full")]
    config.stash[_FULL_LEFT_OUT] = len(full)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if config.stash.get(_FULL_LEFT_OUT, 0):
        terminalreporter.write_line(f"fast tier: {config.stash[_FULL_LEFT_OUT]} tests marked full were deselected; "
                                    "python -m pytest -q --full runs the full suite")


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path
    session: int

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def leftover_workers(self) -> list[int]:
        """Processes the run started that outlive it by more than a moment: its whole session."""
        return lingering(self.session)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / "final_params.pt", weights_only=True)


def run_entry(entry: str, run_dir: Path, *overrides: str, timeout: float = 240, env: dict | None = None) -> Run:
    """Run ``python -m chameleon.<entry>`` with Hydra overrides, its run dir pinned to ``run_dir``, in a new session."""
    cmd = [sys.executable, "-m", f"chameleon.{entry}", f"hydra.run.dir={run_dir}", "output.progress=false", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV,
                            cwd=run_dir.parent, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout} s:\n{err[-4000:]}") from None
    return Run(proc.returncode, out, err, run_dir, proc.pid)


def run_ranks(target: Callable[..., None], world: int, *args, timeout_s: float = 90) -> None:
    """``target(rank, world, port, *args)`` in ``world`` spawned processes (``port`` free for their process group);
    each must exit 0 within ``timeout_s``."""
    port, ctx = free_port_pair(), mp.get_context("spawn")
    procs = [ctx.Process(target=_then_exit, args=(target, r, world, port, *args)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * world


def _then_exit(target: Callable[..., None], *args) -> None:
    """``target(*args)``, then out at once, as a worker leaves (``os._exit``): a rank's process groups and their
    threads are never torn down by the interpreter's exit, which aborted a rank now and then ("terminate called
    without an active exception", exit code -6)."""
    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_nothing_lost(run: Run, reference: Run, *, drift: Drift = Drift()) -> dict:
    """The run ended well, lost and redid nothing (chameleon/report/compare.py), and left no process behind."""
    assert run.returncode == 0, run.stderr
    got = run.summary
    assert not mismatches(got, run.params, reference.summary, reference.params, drift=drift)
    assert not run.leftover_workers()
    return got


def committed(run: Run) -> dict[int, dict]:
    """The ``metrics.jsonl`` record of every step, the last commit winning (a checkpoint reload redoes steps)."""
    lines = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


# Tensor parallelism reassociates inside every matmul (partial sums all-reduced), a larger reordering than data or
# pipeline parallelism's: on SMALL_RUN's samples dp2 × tp2 ends 1.11e-5 (relative) from one process, in
# layers.3.attention.wv after 6 AdamW steps, where changing only the micro-batching of one process moves it
# 1.5e-6 and dp2 × tp2 on the whole corpus (no validation split) 4.7e-6; the losses stay within 1e-5. A lost or
# doubled sample moves parameters by 1e-3 and more. TP layouts' parameters are held to this measured floor, times 2.
TP_PARAMS = Drift(params=2 * 1.12e-5 / 4.0)  # as a Drift: compare.py allows DRIFT_FACTOR (4) times it

# Gradient norms are compared to 1e-4, not the 1e-5 of losses and parameters: a gradient reacts to the
# parameters' accumulated reassociation drift (≤ 1e-5) more than the loss does; the worst measured is
# 1.2e-5 (dp2 × tp2 after a kill). A micro-batch lost or counted twice moves the norm by percents.
GRAD_NORM_TOLERANCE = 1e-4


def assert_same_clipping(run: Run, reference: Run, *, clip_norm: float, tolerance: float = GRAD_NORM_TOLERANCE) -> None:
    """Every step's global gradient norm equals the reference's and was clipped; the learning rate too."""
    got, ref = committed(run), committed(reference)
    assert got.keys() == ref.keys()
    for step, m in ref.items():
        assert m["grad_norm"] > clip_norm, "the reference must clip at every step, or the check proves nothing"
        assert abs(got[step]["grad_norm"] - m["grad_norm"]) <= tolerance * m["grad_norm"], step
        assert got[step]["lr"] == m["lr"], step


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Run:
    """The single-process reference every multi-worker run is compared with."""
    run = run_entry("train", tmp_path_factory.mktemp("ref") / "run", *SMALL_RUN, "launcher.nproc_per_node=1")
    assert run.returncode == 0, run.stderr
    return run


# A short run of the tiny model; every layout test trains exactly these steps, with the global
# gradient norm clipped (it is above 0.5 at every step) and a warm-up + cosine learning rate.
SMALL_RUN = (
    "train.steps=6", "model.dim=64", "model.n_layers=4", "train.global_batch=8", "train.micro_batch=2",
    "train.seq_len=32", "failure=none", "parallel=dp", "train.clip_norm=0.5", "train.lr_schedule=cosine",
    "train.warmup_steps=2",
)
