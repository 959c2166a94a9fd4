"""Selector: Eq. 8 crossover, D estimate, reroute feasibility, forced policies, logging."""

from __future__ import annotations

import json

import pytest

from chameleon.decision.config import PolicyConfig
from chameleon.decision.planner import Planner
from chameleon.decision.selector import decide, estimate_d, precompute_replans, reroute_plan, score
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import PlanError, even_plan, validate_plan
from tests.test_decision_estimator import tiny_profile


def test_eq8_crossover():
    # Reroute t=2, T=0 vs dynamic t=1, T=10, B=10: equal at D=20.
    for d, winner in ((15.0, "reroute"), (40.0, "dynamic")):
        rr = score(global_batch=10, t_step=2.0, transition=0.0, d_s=d)
        dyn = score(global_batch=10, t_step=1.0, transition=10.0, d_s=d)
        assert ("reroute" if rr > dyn else "dynamic") == winner
    assert score(global_batch=10, t_step=2.0, transition=0.0, d_s=20.0) == pytest.approx(
        score(global_batch=10, t_step=1.0, transition=10.0, d_s=20.0))


def test_d_is_gamma_poisson_posterior_mean():
    pol = PolicyConfig(mtbf_prior_s=1000.0, prior_faults=2.0)
    assert estimate_d(pol, fault_times=[], elapsed_s=0.0)[0] == pytest.approx(1000.0)
    # 4 faults in 400 s: (2·1000 + 400) / (2 + 4).
    assert estimate_d(pol, fault_times=[100, 200, 300, 400], elapsed_s=400.0)[0] == pytest.approx(400.0)
    assert estimate_d(PolicyConfig(fixed_d_s=5.0), fault_times=[1.0], elapsed_s=9.0)[0] == 5.0


def test_reroute_infeasible_when_stage_lost_all_replicas():
    plan = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=8, micro_batch=1)
    with pytest.raises(PlanError):
        reroute_plan(plan, {0, 2})  # stage 0 of both pipelines
    rr = reroute_plan(plan, {0})
    assert rr.reroutes[0].pipeline == 0 and rr.reroutes[0].hosts == (1,)
    prof = tiny_profile()
    d = decide(prof, plan, {0, 2}, policy=PolicyConfig(), planner=Planner(prof))
    assert d.choice is None and all(not c.feasible for c in d.candidates)
    d = decide(prof, plan, {0, 2}, policy=PolicyConfig(), planner=Planner(prof), checkpoint_age_s=30.0)
    assert d.choice == "checkpoint"


def test_decision_chooses_by_eq8_and_logs_every_candidate():
    prof = tiny_profile(n_layers=8)
    plan = even_plan(dp=4, pp=4, tp=1, n_layers=8, global_batch=32, micro_batch=1)
    planner = Planner(prof)
    short = decide(prof, plan, {5}, policy=PolicyConfig(fixed_d_s=1e-3), planner=planner)
    long = decide(prof, plan, {5}, policy=PolicyConfig(fixed_d_s=1e9), planner=planner)
    assert long.choice == max((c for c in long.candidates if c.feasible), key=lambda c: c.score).name
    # D below every transition (each rebuilds groups) leaves nothing usable.
    assert short.choice is None and all("D =" in c.why for c in short.candidates if c.plan is not None)
    names = [c.name for c in long.candidates]
    assert names == ["reroute", "dynamic", "redundant", "checkpoint"]
    json.dumps(long.to_dict())
    for c in long.candidates:
        if c.feasible:
            assert c.peak_memory <= prof.memory_bytes and c.plan is not None


def test_a_fault_after_precompute_replans_searches_nothing_and_decides_as_a_cold_planner(monkeypatch):
    """Every search the re-plan weighs (the best on the survivors, on fewer units, of two pipelines) ran ahead."""
    prof = tiny_profile(n_layers=8)
    plan = even_plan(dp=2, pp=4, tp=1, n_layers=8, global_batch=16, micro_batch=1)
    cold = decide(prof, plan, {1}, policy=PolicyConfig(fixed_d_s=1e6), planner=Planner(prof))
    warm = Planner(prof)
    ahead = precompute_replans(plan, warm, {1})
    searches = []
    for planner in (warm, warm.replicated):
        monkeypatch.setattr(planner, "_fast", lambda *args: searches.append(args))
    units = geometry_of(plan).units(set(plan.devices) - {1})
    d = decide(prof, plan, {1}, policy=PolicyConfig(fixed_d_s=1e6), planner=warm,
               precomputed=ahead.plan_for(units, plan, prof))
    assert searches == [], "a likely fault needs no search"
    assert d.choice == cold.choice and d.chosen.plan == cold.chosen.plan


def test_forced_policy_goes_through_the_same_machinery():
    prof = tiny_profile(n_layers=8)
    plan = even_plan(dp=4, pp=4, tp=1, n_layers=8, global_batch=32, micro_batch=1)
    for name in ("reroute", "dynamic", "redundant"):
        d = decide(prof, plan, {5}, policy=PolicyConfig(name=name, fixed_d_s=1e6), planner=Planner(prof))
        assert d.choice == name and d.note == ""
    d = decide(prof, plan, {5}, policy=PolicyConfig(name="checkpoint", fixed_d_s=1e6), planner=Planner(prof))
    assert d.choice != "checkpoint" and "infeasible" in d.note


@pytest.mark.parametrize("pp", [3, 4])
def test_every_pair_of_simultaneous_losses_gets_a_decision_never_an_error(pp):
    """Two devices lost at once, anywhere in a dp2 plan of 3 or 4 stages: every candidate is built or refused with
    its reason, a feasible plan covers every layer once per pipeline, and the choice exists when a replica does."""
    profile = tiny_profile(n_layers=8)
    plan = even_plan(dp=2, pp=pp, tp=1, n_layers=8, global_batch=8, micro_batch=1)
    planner = Planner(profile)
    devices = plan.devices
    for i, a in enumerate(devices):
        for b in devices[i + 1:]:
            decision = decide(profile, plan, {a, b}, policy=PolicyConfig(), planner=planner, checkpoint_age_s=30.0)
            for c in decision.candidates:
                assert c.feasible or c.why, (a, b, c.name)
                if c.feasible:
                    validate_plan(c.plan)
                    assert not {a, b} & set(c.plan.devices)
            if a % pp == b % pp:  # both replicas of one stage: only the checkpoint restores it
                assert decision.choice == "checkpoint"
            else:
                assert decision.choice in {"reroute", "dynamic", "redundant", "checkpoint"}
