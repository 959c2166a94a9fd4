"""Planner: equals exhaustive search on small cases; plans are memory-feasible and use every survivor."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from chameleon.decision import estimator as est
from chameleon.decision.planner import Gate, Planner, place, precompute
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import Pipeline, Plan, PlanError, Stage, even_plan, validate_plan
from tests.test_decision_estimator import tiny_profile

ROOT = Path(__file__).resolve().parents[1]


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield [b - a for a, b in zip((0,) + cuts, cuts + (total,))]


def _partitions(n, lengths, smallest=1):
    if n == 0:
        yield []
    for p in lengths:
        if p >= smallest and p <= n:
            for rest in _partitions(n - p, lengths, p):
                yield [p] + rest


def _exhaustive(profile, n_units, n_micro, lengths, dp_degrees=None):
    """Every partition × every layer split per pipeline × every micro-batch share, exact estimator."""
    best = math.inf
    for part in _partitions(n_units, lengths):
        if len(part) > n_micro or (dp_degrees and len(part) not in dp_degrees):
            continue
        splits = [list(_compositions(profile.n_layers, p)) for p in part]
        for layer_choice in itertools.product(*splits):
            for micro in _compositions(n_micro, len(part)):
                dev = iter(range(n_units))
                pipes = []
                for sizes, m in zip(layer_choice, micro):
                    bounds = list(itertools.accumulate([0] + sizes))
                    pipes.append(Pipeline(tuple(Stage((next(dev),), (a, b)) for a, b in zip(bounds, bounds[1:])), m))
                plan = Plan(profile.n_layers, 1, tuple(pipes))
                if max(est.memory_per_device(profile, plan).values()) > profile.memory_bytes:
                    continue
                best = min(best, est.estimate_step(profile, plan).t_step)
    return best


@pytest.mark.parametrize(
    "n_units,n_micro,memory_gb,inter_gbps",
    [(3, 4, 1.0, 1.0), (4, 5, 1.0, 1.0), (5, 6, 0.0045, 1.0), (5, 8, 1.0, 10.0), (7, 9, 1.0, 10.0),
     (6, 12, 0.0045, 10.0),
     # DP sync of the heaviest stage dominates: a split with a lighter embedding stage wins.
     (5, 4, 1.0, 0.05), (6, 4, 1.0, 1.0)],
)
def test_fast_planner_equals_exhaustive(n_units, n_micro, memory_gb, inter_gbps):
    prof = tiny_profile(memory_gb=memory_gb, dp_bw=inter_gbps * 1e9)
    lengths = range(1, prof.n_layers + 1)
    want = _exhaustive(prof, n_units, n_micro, lengths)
    got = Planner(prof).best([(d,) for d in range(n_units)], n_micro=n_micro, micro_batch_size=1)
    assert got.estimate.t_step == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_planner_equals_exhaustive_on_random_small_cases(seed):
    rng = random.Random(seed)
    prof = tiny_profile(n_layers=rng.choice([3, 4, 5]), memory_gb=rng.choice([1.0, 0.0045]),
                        dp_bw=rng.choice([0.05, 1.0, 10.0]) * 1e9)
    n_units, n_micro = rng.randint(2, 6), rng.randint(2, 9)
    lengths = sorted(rng.sample(range(1, prof.n_layers + 1), rng.randint(2, prof.n_layers)))
    dp_degrees = sorted(rng.sample(range(1, n_units + 1), rng.randint(1, n_units)))
    want = _exhaustive(prof, n_units, n_micro, lengths, dp_degrees)
    planner = Planner(prof, pp_lengths=tuple(lengths), dp_degrees=tuple(dp_degrees))
    units = [(d,) for d in range(n_units)]
    if math.isinf(want):
        with pytest.raises(PlanError):
            planner.best(units, n_micro=n_micro, micro_batch_size=1)
    else:
        assert planner.best(units, n_micro=n_micro, micro_batch_size=1).estimate.t_step == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("n_units", [7, 13, 31])
def test_plans_are_feasible_and_use_every_survivor(n_units):
    prof = tiny_profile(n_layers=8, memory_gb=0.006)
    planner = Planner(prof)
    units = [(d,) for d in range(100, 100 + n_units)]
    result = planner.best(units, n_micro=64, micro_batch_size=2)
    validate_plan(result.plan)
    assert sorted(result.plan.devices) == [u[0] for u in units]
    assert result.plan.n_micro_batches == 64
    assert max(est.memory_per_device(prof, result.plan).values()) <= prof.memory_bytes


def test_tp_groups_are_units_and_ranges_are_respected():
    prof = tiny_profile(n_layers=8)
    planner = Planner(prof, pp_lengths=(2, 3), dp_degrees=(2, 3))
    units = [(2 * i, 2 * i + 1) for i in range(7)]
    plan = planner.best(units, n_micro=12, micro_batch_size=1).plan
    assert {p.n_stages for p in plan.pipelines} <= {2, 3} and plan.dp in (2, 3)
    assert all(st.devices in units for p in plan.pipelines for st in p.stages)


def test_precomputed_shapes_serve_any_fault_that_leaves_as_many_units():
    prof = tiny_profile(n_layers=8)
    plan = even_plan(dp=2, pp=4, tp=1, n_layers=8, global_batch=16, micro_batch=1)
    planner = Planner(prof)
    table = precompute(plan, planner, {1, 4})
    assert sorted(table.shapes) == [4, 7]
    for dead in ({3}, {4, 5, 6, 7}):
        units = geometry_of(plan).units(set(range(8)) - dead)
        new = table.plan_for(units, plan, prof)
        validate_plan(new)
        assert sorted(new.devices) == sorted(d for d in range(8) if d not in dead)
        searched = place(planner.choose(units, n_micro=16, micro_batch_size=1), plan, prof)
        assert est.estimate_step(prof, new).t_step == pytest.approx(est.estimate_step(prof, searched).t_step)
    assert table.plan_for(geometry_of(plan).units(range(2, 8)), plan, prof) is None, "six units left: not searched"


def test_a_precompute_loads_the_solver_a_placement_at_the_fault_may_need():
    """Placing survivors of several kinds solves an LP (scipy, 0.4 s to import): the precompute, after the job
    started, loads it, so the first fault's decision does not."""
    script = ("import sys\n"
              "from chameleon.decision.planner import Planner, precompute\n"
              "from chameleon.layout.plan import even_plan\n"
              "from tests.test_decision_estimator import tiny_profile\n"
              "assert 'scipy.optimize' not in sys.modules, 'imported on start-up'\n"
              "plan = even_plan(dp=2, pp=4, tp=1, n_layers=8, global_batch=16, micro_batch=1)\n"
              "precompute(plan, Planner(tiny_profile(n_layers=8)), {1, 4})\n"
              "assert 'scipy.optimize' in sys.modules, 'not loaded by the precompute'\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


class _Ticks:
    """A clock that advances one second per reading: a bounded search expires after a known number of checks."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_bounded_search_returns_its_best_so_far_feasible_and_uncached(monkeypatch):
    prof = tiny_profile(n_layers=8, memory_gb=0.006)
    units = [(d,) for d in range(31)]
    full = Planner(prof).best(units, n_micro=64, micro_batch_size=2).estimate.t_step
    planner = Planner(prof)
    monkeypatch.setattr("chameleon.decision.planner.time.perf_counter", _Ticks())
    bounded = planner.within(20.0)
    result = bounded.best(units, n_micro=64, micro_batch_size=2)
    assert bounded.expired and not planner.expired
    validate_plan(result.plan)
    assert sorted(result.plan.devices) == list(range(31))
    assert result.estimate.t_step >= full * (1 - 1e-9)  # anytime: never better than the whole search
    assert planner._searched == {} and planner.replicated._searched == {}, "a cut-short search is not cached"


def test_an_ample_budget_finds_the_unbounded_plan_and_shares_the_cache():
    prof = tiny_profile(n_layers=8, memory_gb=0.006)
    units = [(d,) for d in range(13)]
    planner = Planner(prof)
    bounded = planner.within(3600.0)
    got = bounded.best(units, n_micro=64, micro_batch_size=2).estimate.t_step
    assert not bounded.expired and (13, 64) in planner._searched
    assert got == pytest.approx(Planner(prof).best(units, n_micro=64, micro_batch_size=2).estimate.t_step, rel=1e-12)
    assert planner.within(None) is planner  # no gate to leave out: the planner itself


def test_a_budget_spent_before_any_plan_names_the_key(monkeypatch):
    prof = tiny_profile(n_layers=8)
    monkeypatch.setattr("chameleon.decision.planner.time.perf_counter", _Ticks())
    with pytest.raises(PlanError, match=r"policy\.decide_budget_s"):
        Planner(prof).within(0.5).choose([(d,) for d in range(7)], n_micro=16, micro_batch_size=1)


def test_a_decisions_later_searches_reuse_what_its_budget_found(monkeypatch):
    prof = tiny_profile(n_layers=8, memory_gb=0.006)
    monkeypatch.setattr("chameleon.decision.planner.time.perf_counter", _Ticks())
    bounded = Planner(prof).within(20.0)
    units = [(d,) for d in range(31)]
    first = bounded.choose(units, n_micro=64, micro_batch_size=2)
    assert bounded.expired and bounded.choose(units, n_micro=64, micro_batch_size=2) == first


def test_a_search_ahead_of_need_waits_while_a_decision_holds_the_gate():
    """A precompute's planner has the workshop's gate; while a decision holds it closed, the precompute's search
    waits at its next step, and the decision's planner (``within``, even unbounded) never does."""
    prof = tiny_profile(n_layers=8, memory_gb=0.006)
    units = [(d,) for d in range(31)]
    ahead, gate = Planner(prof), Gate()
    ahead.gate = gate
    finished = threading.Event()
    with gate.closed():
        for budget in (None, 3600.0):
            deciding = ahead.within(budget)
            assert deciding.gate is None and deciding.replicated.gate is None
        deciding.best([(d,) for d in range(13)], n_micro=64, micro_batch_size=2)  # while the gate is closed
        searching = threading.Thread(target=lambda: (ahead.search(len(units), 64), finished.set()), daemon=True)
        searching.start()
        assert not finished.wait(0.5), "the search ahead of need waits for the decision"
    assert finished.wait(60), "and goes on once it is done"
    assert (31, 64) in ahead._searched
