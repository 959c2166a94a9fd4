"""A TP group that loses one device: its survivors re-formed at a smaller TP size (``reform``), the shards they
lack rebuilt from the other replica, so every layer keeps two holders and a second fault in the other replica is
recovered. Real workers, compared with the single-process reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import SMALL_RUN, TP_PARAMS, assert_nothing_lost, run_entry

from chameleon.decision import estimator as est
from chameleon.decision.selector import reform_options, reform_plans
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import even_plan
from tests.test_decision_estimator import tiny_profile

TP4 = ("launcher.nproc_per_node=8", "parallel.dp=2", "parallel.tp=4", "model.n_kv_heads=4")


def test_the_survivors_of_a_broken_tp4_group_re_form_at_smaller_tp_sizes_keeping_two_holders_of_every_layer():
    plan = even_plan(dp=2, pp=2, tp=4, n_layers=4, global_batch=8, micro_batch=1)  # pipe1: stages on 8–11, 12–15
    options = reform_options(4, plan.pipelines[1], {9}, tp_sizes=(1, 2, 4))
    assert [[(st.devices, st.layers) for st in o.stages] for o in options] == [
        [((8, 10), (0, 2)), ((12, 14), (2, 4))],  # layers kept at tp2: old shards 0 and 2, least moved
        [((8, 10, 11, 12), (0, 4))],  # every survivor it can use at tp4: one stage
        [((8, 10), (0, 1)), ((12, 11), (1, 2)), ((13, 14), (2, 4))],  # at tp2: three stages
        [((8,), (0, 1)), ((10,), (1, 2)), ((11,), (2, 3)), ((12,), (3, 4))],  # at tp1: one layer each
    ]
    least, fastest = reform_plans(tiny_profile(), plan, {9}, tp_sizes=(1, 2, 4))
    assert least.pipelines[1].stages == options[0].stages and least.pipelines[0].stages == plan.pipelines[0].stages
    assert fastest.pipelines[1].stages in [o.stages for o in options[1:]]
    assert est.estimate_step(tiny_profile(), fastest).t_step < est.estimate_step(tiny_profile(), least).t_step
    for reformed in (least, fastest):
        assert reformed.n_micro_batches == plan.n_micro_batches
        assert geometry_of(reformed).exposure(None) == 0.0 and geometry_of(reformed).lost({1}) == ()
    assert [st.tp for st in reform_options(4, plan.pipelines[1], {9, 10, 11}, tp_sizes=(1, 2, 4))[0].stages] \
        == [1, 1], "its layers kept: the TP size its scarcest stage can fill"
    whole_stage = reform_options(4, plan.pipelines[1], {8, 9, 10, 11}, tp_sizes=(1, 2, 4))
    assert whole_stage[0].stages[0].devices == (12, 13, 14, 15), "a whole stage lost: the other's survivors take all"
    with pytest.raises(ValueError, match="no broken TP group"):
        reform_plans(tiny_profile(), plan, set(range(8, 16)), tp_sizes=(1, 2, 4))  # the whole pipeline lost


def test_a_re_formed_group_that_would_not_fit_in_memory_is_not_weighed():
    plan = even_plan(dp=2, pp=1, tp=4, n_layers=4, global_batch=8, micro_batch=1)
    tp4_only = replace(tiny_profile(), memory_bytes=max(est.memory_per_device(tiny_profile(), plan).values()) * 1.01)
    with pytest.raises(ValueError, match="within memory"):
        reform_plans(tp4_only, plan, {5}, tp_sizes=(1, 2, 4))  # three survivors: tp2 or tp1 shards are larger


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
