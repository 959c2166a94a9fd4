"""The selector's price of the next fault: exposure, expected checkpoint age, fault cost, and the choices they change."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chameleon.decision import estimator as est
from chameleon.decision.config import PolicyConfig
from chameleon.decision.planner import Planner
from chameleon.decision.selector import (
    Fallback, decide, decide_growth, expected_age, fault_cost_s, reroute_plan, risk_score, score,
)
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import even_plan
from tests.test_decision_estimator import tiny_profile


def _age_by_quadrature(age_s: float, interval_s: float, d_s: float) -> float:
    """E[age at the fault] integrated numerically: the fault at x ~ Exp(1/d_s); checkpoints at
    interval_s − age_s, then every interval_s; the age is the time since the newest one (or age_s + x before it)."""
    x = np.linspace(0.0, 60 * d_s, 2_000_001)
    first = interval_s - age_s
    age = np.where(x < first, age_s + x, np.mod(x - first, interval_s))
    density = np.exp(-x / d_s) / d_s
    return float(np.trapezoid(age * density, x))


def test_expected_age_by_hand_and_by_quadrature():
    # a = 10, I = 30, D = 20: L = 20, e^{-1} = 0.367879;
    # within = 10·(1 − e^{-1}) + 20 − 40·e^{-1} = 11.606028; periodic = 20 − 30·e^{-1.5}/(1 − e^{-1.5}) = 11.383503;
    # E = 11.606028 + e^{-1} · 11.383503 = 15.793778.
    assert expected_age(10.0, 30.0, 20.0) == pytest.approx(15.793778, rel=1e-6)
    for age, interval, d in ((10.0, 30.0, 20.0), (0.0, 100.0, 1000.0), (250.0, 300.0, 40.0), (5.0, 3600.0, 600.0)):
        assert expected_age(age, interval, d) == pytest.approx(_age_by_quadrature(age, interval, d), rel=1e-4)
    # No checkpoint to come: the newest one just keeps ageing until the fault.
    assert expected_age(10.0, None, 20.0) == 30.0
    # Frequent checkpoints: the age at the fault is about half an interval, whatever it is now.
    assert expected_age(7.0, 10.0, 1e6) == pytest.approx(5.0, rel=1e-3)


def exposure(plan, domains):
    return geometry_of(plan).exposure(domains)


def test_exposure_counts_the_domains_whose_loss_leaves_a_region_bare():
    two = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=8, micro_batch=1)  # pipelines on (0, 1) and (2, 3)
    one = even_plan(dp=1, pp=4, tp=1, n_layers=4, global_batch=8, micro_batch=1)
    assert exposure(two, None) == 0.0  # every layer on two devices
    assert exposure(one, None) == 1.0  # every device holds the only copy of its layers
    assert exposure(two, ((0, 1), (2, 3))) == 0.0  # a node per pipeline
    assert exposure(two, ((0, 2), (1, 3))) == 1.0  # each node holds both copies of a stage
    assert exposure(two, ((0, 2), (1,), (3,))) == pytest.approx(1 / 3)
    rerouted = reroute_plan(two, {0})  # stage 0 now lives on device 2 alone
    assert exposure(rerouted, None) == pytest.approx(1 / 3)
    # TP 2, pipelines on (0, 1) and (2, 3): a node of (0, 3) touches both stage replicas, but shard 0 lives on 0 and 2,
    # shard 1 on 1 and 3: no node holds every holder of a shard, so nothing is exposed; nodes (0, 2), (1, 3) are.
    tp2 = even_plan(dp=2, pp=1, tp=2, n_layers=4, global_batch=8, micro_batch=1)
    assert exposure(tp2, ((0, 3), (1, 2))) == 0.0
    assert exposure(tp2, ((0, 2), (1, 3))) == 1.0
    assert exposure(tp2, None) == 0.0


def test_fault_cost_is_a_reload_and_the_rolled_back_progress_or_the_whole_run():
    prof = tiny_profile(n_layers=4, restart_s=50.0)
    plan = even_plan(dp=1, pp=4, tp=1, n_layers=4, global_batch=8, micro_batch=1)
    reload = est.checkpoint_time(prof, 4)
    assert fault_cost_s(prof, plan, Fallback(elapsed_s=900.0), 100.0) == 1000.0
    assert fault_cost_s(prof, plan, Fallback(checkpoint_age_s=10.0), 20.0) == pytest.approx(50.0 + reload + 30.0)
    got = fault_cost_s(prof, plan, Fallback(checkpoint_age_s=10.0, checkpoint_interval_s=30.0, in_process=True), 20.0)
    assert got == pytest.approx(est.rebuild_time(prof, plan) + reload + 15.793778, rel=1e-6)


def test_risk_score_is_eq8_less_the_expected_cost():
    # B = 10, t = 1, T = 10, D = 100, p = 0.5, C = 40: 10 · (100 − 10 − 20) / 100 = 7.
    assert risk_score(global_batch=10, t_step=1.0, transition=10.0, d_s=100.0, exposure=0.5, cost_s=40.0) == pytest.approx(7.0)
    assert risk_score(global_batch=10, t_step=2.0, transition=3.0, d_s=50.0, exposure=0.0, cost_s=1e9) == score(
        global_batch=10, t_step=2.0, transition=3.0, d_s=50.0)


def _single_fault(**kwargs):
    prof = tiny_profile(n_layers=8)
    plan = even_plan(dp=2, pp=2, tp=1, n_layers=8, global_batch=8, micro_batch=1)
    return decide(prof, plan, {0}, policy=PolicyConfig(fixed_d_s=3600.0), planner=Planner(prof), **kwargs)


def test_without_a_checkpoint_the_replan_keeps_every_layer_twice():
    """On three survivors the fastest plan is one pipeline; with no checkpoint its next fault ends the run, so the
    re-plan keeps two pipelines; a fresh checkpoint every minute makes that fault cheap and the fast plan wins."""
    prof = tiny_profile(n_layers=8)
    fastest = Planner(prof).best([(1,), (2,), (3,)], n_micro=8, micro_batch_size=1).plan
    assert fastest.dp == 1 and exposure(fastest, None) == 1.0
    bare = _single_fault(elapsed_s=1e5)
    assert bare.choice == "dynamic" and bare.chosen.plan.dp == 2 and bare.chosen.exposure == 0.0
    saved = _single_fault(elapsed_s=1e5, checkpoint_age_s=0.0, checkpoint_interval_s=60.0)
    assert saved.chosen.plan.dp == 1 and saved.chosen.exposure == 1.0 and saved.chosen.fault_cost_s > 0
    # The price enters the score as extra transition time: p · C seconds.
    c = saved.chosen
    assert c.score == pytest.approx(score(global_batch=8, t_step=c.t_step, transition=c.transition + c.fault_cost_s, d_s=3600.0))


def test_reroute_leaves_one_copy_and_pays_for_it():
    d = _single_fault(elapsed_s=1e5)
    rr = next(c for c in d.candidates if c.name == "reroute")
    assert rr.exposure == pytest.approx(1 / 3) and rr.fault_cost_s == pytest.approx(1e5 + 3600.0)
    assert rr.score < score(global_batch=8, t_step=rr.t_step, transition=rr.transition, d_s=3600.0)


def test_growth_prices_staying_exposed():
    """One pipeline on devices 0, 1 and a node (2, 3) back: staying exposes every layer to the next fault
    of node (0, 1) — one of the two nodes, as a fault of the idle node costs nothing — or of either
    device alone; growing to two pipelines, one per node, exposes nothing, so it wins though it pauses."""
    prof = tiny_profile(n_layers=8)
    planner = Planner(prof)
    plan = even_plan(dp=1, pp=2, tp=1, n_layers=8, global_batch=8, micro_batch=1)
    for domains, share in ((((0, 1), (2, 3)), 0.5), (None, 1.0)):
        d = decide_growth(prof, plan, {2, 3}, policy=PolicyConfig(fixed_d_s=3600.0), planner=planner,
                          elapsed_s=1e5, domains=domains)
        stay, grow = d.candidates
        assert stay.exposure == share and stay.fault_cost_s == pytest.approx(1e5 + 3600.0)
        assert d.choice == "grow" and grow.exposure == 0.0 and exposure(grow.plan, ((0, 1), (2, 3))) == 0.0
        assert math.isclose(grow.fault_cost_s, 0.0)
