"""chameleon/report/compare.py: a run whose loss list is cut short is a mismatch, never a pass or a crash."""

from __future__ import annotations

import pytest
import torch

from chameleon.report.compare import Drift, loss_difference, mismatches

LOSSES = [2.5, 2.4, 2.3, 2.2, 2.1]
PARAMS = {"w": torch.ones(3)}


def summary(losses: list[float]) -> dict:
    return {"steps_completed": len(LOSSES), "sample_ids_digest": "d", "first_step": 0, "losses": losses}


def test_identical_runs_match():
    assert mismatches(summary(LOSSES), PARAMS, summary(LOSSES), PARAMS) == []


@pytest.mark.parametrize("run, reference, expected", [
    (LOSSES[:3], LOSSES, "the run has 2 step loss(es) fewer than the reference (3, not 5)"),
    (LOSSES, LOSSES[:4], "the reference has 1 step loss(es) fewer than the run (4, not 5)"),
])
def test_a_truncated_loss_list_is_a_mismatch_naming_the_shorter_run(run, reference, expected):
    assert mismatches(summary(run), PARAMS, summary(reference), PARAMS) == [expected]


def test_a_truncated_list_still_reports_a_differing_loss_before_the_cut():
    got = mismatches(summary([2.5, 2.6]), PARAMS, summary(LOSSES), PARAMS)
    assert got == ["the run has 3 step loss(es) fewer than the reference (2, not 5)",
                   "loss of step 1 is 2.6, not 2.4 (bound 1.0e-05)"]


def test_the_drift_of_lists_of_different_lengths_is_refused():
    with pytest.raises(ValueError, match=r"the second has 1 step loss\(es\) fewer than the first \(4, not 5\)"):
        loss_difference(LOSSES, LOSSES[:4])
    with pytest.raises(ValueError, match="the first has 1"):
        Drift.between(summary(LOSSES[:4]), PARAMS, summary(LOSSES), PARAMS)
