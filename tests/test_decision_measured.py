"""Measured step times: a plan's shape, the estimator's scale, and the choice they overturn."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chameleon.decision import estimator as est
from chameleon.decision.config import PolicyConfig
from chameleon.decision.measured import MIN_STEPS, Measured, plan_shape
from chameleon.decision.planner import Planner
from chameleon.decision.selector import decide_growth, reroute_plan
from chameleon.layout.plan import Stage, even_plan
from tests.test_decision_estimator import tiny_profile


def _moved(plan, mapping):
    """``plan`` with every device renamed by ``mapping``."""
    return replace(plan, pipelines=tuple(
        replace(p, stages=tuple(Stage(tuple(mapping[d] for d in s.devices), s.layers) for s in p.stages))
        for p in plan.pipelines))


def test_a_plans_shape_ignores_which_devices_run_it():
    plan = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=8, micro_batch=1)
    assert plan_shape(_moved(plan, {0: 5, 1: 4, 2: 7, 3: 6})) == plan_shape(plan)
    assert plan_shape(replace(plan, pipelines=plan.pipelines[::-1])) == plan_shape(plan)
    assert plan_shape(even_plan(dp=1, pp=4, tp=1, n_layers=4, global_batch=8, micro_batch=1)) != plan_shape(plan)
    assert plan_shape(even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=8, micro_batch=2)) != plan_shape(plan)
    assert plan_shape(reroute_plan(plan, {0})) != plan_shape(plan)


def test_measured_times_stand_in_for_estimates_and_scale_the_rest():
    full = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=8, micro_batch=1)
    half = even_plan(dp=2, pp=1, tp=1, n_layers=4, global_batch=8, micro_batch=1)
    deep = even_plan(dp=1, pp=4, tp=1, n_layers=4, global_batch=8, micro_batch=1)
    m = Measured.of([(full, [0.3, 0.1, 0.2]), (half, [0.8, 0.4, 0.5, 0.9]), (deep, [0.1] * (MIN_STEPS - 1))],
                    half, estimate_s=0.25)
    assert m.scale == pytest.approx(0.65 / 0.25)  # the median of the plan running now over its estimate
    assert m.step_s(_moved(full, {0: 4, 1: 5, 2: 6, 3: 7}), 99.0) == pytest.approx(0.2)
    assert m.step_s(deep, 0.1) == pytest.approx(0.26), "too few steps ran to trust: the scaled estimate"
    assert m.plans_on({0, 1, 2, 3}) == [full, half] and m.plans_on({0, 1}) == [half]
    assert Measured.of([(full, [0.2] * MIN_STEPS)], half, estimate_s=0.25).scale == 1.0, "the plan running now not measured"


def test_a_layout_measured_faster_wins_a_growth_the_estimate_would_decline():
    """Four processes on one core: the estimator expects two devices to train faster than four, so devices coming
    back are declined. Measured, the four-device layout ran twice as fast: it is an option again, and it wins."""
    prof = tiny_profile(n_layers=4, host_cores=1.0, n_devices=4, devices_per_node=4)
    full = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=8, micro_batch=1)
    half = even_plan(dp=2, pp=1, tp=1, n_layers=4, global_batch=8, micro_batch=1)
    t_half = est.estimate_step(prof, half).t_step
    assert est.estimate_step(prof, full).t_step > t_half
    kw = dict(policy=PolicyConfig(fixed_d_s=3600.0), planner=Planner(prof))
    assert decide_growth(prof, half, {2, 3}, **kw).choice == "stay"
    measured = Measured.of([(full, [t_half / 2] * MIN_STEPS), (half, [t_half] * MIN_STEPS)], half, t_half)
    grown = decide_growth(prof, half, {2, 3}, measured=measured, **kw)
    assert grown.choice == "grow" and grown.chosen.plan == full
    assert grown.chosen.t_step == pytest.approx(t_half / 2)
