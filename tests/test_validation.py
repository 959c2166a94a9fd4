"""The validation loss, taken by the plan's pipelines forward-only: equal on every layout, redone after a fault in it."""

from __future__ import annotations

import json

import pytest

from chameleon.report.compare import Drift

from conftest import SMALL_RUN, TP_PARAMS, Run, assert_nothing_lost, run_entry

EVERY_3 = (*SMALL_RUN, "train.eval_interval=3")  # validation before steps 3 and 6 (after the last)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> Run:
    run = run_entry("train", tmp_path_factory.mktemp("val") / "run", *EVERY_3, "launcher.nproc_per_node=1")
    assert run.returncode == 0, run.stderr
    assert [step for step, _ in run.summary["val_losses"]] == [3, 6]
    return run


def test_a_kill_during_validation_is_recovered_and_the_validation_redone(tmp_path, single_process):
    run = run_entry("train", tmp_path / "run", *EVERY_3, "launcher.nproc_per_node=4", "parallel.dp=2",
                    "parallel.pp=2", "failure=kill", "failure.rank=1", "failure.step=3", "failure.phase=eval")
    got = assert_nothing_lost(run, single_process)  # the losses, validation losses and samples of one process
    assert "device 1: step 3, eval of batch 0" in run.stderr
    assert [r["step"] for r in got["recoveries"]] == [3]
    assert got["final_val_loss"] == got["val_losses"][-1][1]
    assert f"validation loss after step 6: {got['final_val_loss']:.4f}" in run.stderr
    events = [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "validated"] == [3, 6]  # each taken once, recorded once
    metrics = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "val_loss" in m] == [3]  # step 3 trained from the parameters it judged


@pytest.mark.full
def test_a_kill_during_the_last_validation_ends_with_it_redone(tmp_path, single_process):
    """Every step is committed when the fault strikes: the survivors re-form only to take the last validation."""
    run = run_entry("train", tmp_path / "run", *EVERY_3, "launcher.nproc_per_node=4", "parallel.dp=2",
                    "parallel.pp=2", "failure=kill", "failure.rank=1", "failure.step=6", "failure.phase=eval")
    got = assert_nothing_lost(run, single_process)
    assert [r["step"] for r in got["recoveries"]] == [6]
    assert "the last validation redone" in run.stderr


@pytest.mark.full
@pytest.mark.parametrize("layout", [("parallel.dp=2", "parallel.tp=2"), ("parallel.dp=1", "parallel.pp=4")],
                         ids=["dp2xtp2", "pp4"])
def test_every_layout_takes_the_same_validation_loss(tmp_path, single_process, layout):
    run = run_entry("train", tmp_path / "run", *EVERY_3, "launcher.nproc_per_node=4", *layout)
    assert_nothing_lost(run, single_process, drift=TP_PARAMS if "parallel.tp=2" in layout else Drift())
