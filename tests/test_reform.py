"""A TP group that loses one device: its survivors re-formed at a smaller TP size (``reform``), the shards they
lack rebuilt from the other replica, so every layer keeps two holders and a second fault in the other replica is
recovered. Real workers, compared with the single-process reference."""

from __future__ import annotations

import pytest
from conftest import SMALL_RUN, TP_PARAMS, assert_nothing_lost, run_entry

from chameleon.decision.selector import reform_plan
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import even_plan
from tests.test_decision_estimator import tiny_profile

TP4 = ("launcher.nproc_per_node=8", "parallel.dp=2", "parallel.tp=4", "model.n_kv_heads=4")


def test_the_survivors_of_a_broken_tp4_group_re_form_at_tp2_keeping_two_holders_of_every_layer():
    plan = even_plan(dp=2, pp=2, tp=4, n_layers=4, global_batch=8, micro_batch=1)  # pipe1: stages on 8–11, 12–15
    reformed = reform_plan(tiny_profile(), plan, {9}, tp_sizes=(1, 2, 4))
    (kept, pipe) = reformed.pipelines
    assert kept.stages == plan.pipelines[0].stages and [st.tp for st in pipe.stages] == [2, 2]
    assert pipe.stages[0].devices == (8, 10) and pipe.stages[1].devices == (12, 14)  # old shards 0 and 2: least moved
    assert reformed.n_micro_batches == plan.n_micro_batches and kept.micro_batches > pipe.micro_batches
    assert geometry_of(reformed).exposure(None) == 0.0 and geometry_of(reformed).lost({1}) == ()
    assert [st.tp for st in reform_plan(tiny_profile(), plan, {9, 10, 11}, tp_sizes=(1, 2, 4)).pipelines[1].stages] \
        == [1, 1], "one TP size per pipeline: the one its scarcest stage can fill"
    with pytest.raises(ValueError, match="no broken TP group"):
        reform_plan(tiny_profile(), plan, {8, 9, 10, 11}, tp_sizes=(1, 2, 4))  # a whole stage lost


@pytest.fixture(scope="module")
def kv4_reference(tmp_path_factory):
    """The single-process reference of SMALL_RUN's model with 4 KV heads (so that TP 4 divides them)."""
    run = run_entry("train", tmp_path_factory.mktemp("ref_kv4") / "run", *SMALL_RUN, "model.n_kv_heads=4",
                    "launcher.nproc_per_node=1")
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.full
def test_a_tp_group_losing_a_device_re_forms_and_a_second_fault_in_the_other_replica_is_recovered(tmp_path,
                                                                                                  kv4_reference):
    run = run_entry("train", tmp_path / "run", *SMALL_RUN, *TP4, "failure=schedule",
                    "failure.faults=[{kind:kill,rank:5,step:2,phase:forward},{kind:kill,rank:1,step:4,phase:forward}]")
    got = assert_nothing_lost(run, kv4_reference, drift=TP_PARAMS)  # the failure-free losses, samples, parameters
    first, second = got["recoveries"]
    assert first["failed_ranks"] == [5] and first["chosen"] == "reform"
    assert second["failed_ranks"] == [1], "recovered, not stopped: the re-formed replica held every layer"
