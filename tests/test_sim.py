"""Simulator: accounting, references, determinism, policy ordering, traces, placement and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from scipy.optimize import linear_sum_assignment

from chameleon.config import CONF_DIR, build_plan, register_configs
from chameleon.decision import estimator as est
from chameleon.decision.planner import place
from chameleon.layout.geometry import geometry_of
from chameleon.sim.config import SimPolicy
from chameleon.sim.engine import POLICY_CLASSES, make_policy, simulate
from chameleon.sim.policies import Planning
from chameleon.sim.traces import Event, oobleck_trace, poisson_trace, read_csv, write_csv
from chameleon.simulate import prepare
from tests.conftest import ENV

register_configs()
BASE = ("+recipe=llama7b", "cluster=ascend910b_32", "sim.progress=false", "sim.plots=false")
ALL = tuple(SimPolicy)
OWN_LAYOUT = ("bamboo", "oobleck")  # lay the cluster out by their own rules: shadow stages, ≥ f+1 templates
COMMON_START = tuple(p for p in ALL if p not in OWN_LAYOUT)
BLOCKING_WRITES = ("checkpoint", "failstop")  # checkpoint-restart pauses for its writes


def compose_sim(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=[*BASE, *overrides])


def setup_for(*overrides: str):
    return prepare(compose_sim(*overrides))


def run_all(*overrides: str, policies=ALL):
    setup, events, horizon, _ = setup_for(*overrides)
    return {p: simulate(setup, p, events, horizon_s=horizon) for p in policies}, setup, events, horizon


def test_every_policy_name_has_a_model():
    assert set(POLICY_CLASSES) == set(SimPolicy)


def test_no_fault_runs_at_each_policys_own_failure_free_throughput():
    runs, setup, events, horizon = run_all("trace=none", "sim.horizon_h=2")
    assert events == ()
    ref = setup.reference_throughput
    assert ref >= setup.plan.global_batch / est.estimate_step(setup.planning.profile, setup.plan).t_step
    for name, res in runs.items():
        assert res.initial_throughput <= ref * (1 + 1e-9)
        if name in BLOCKING_WRITES:  # pays its checkpoint writes
            assert res.throughput < res.initial_throughput and res.breakdown["checkpoint"] > 0
        else:
            assert res.throughput == pytest.approx(res.initial_throughput, rel=1e-9)
            assert res.breakdown["checkpoint"] == 0 and res.breakdown["redone"] == pytest.approx(0, abs=1e-6)
        pauses = ("detection", "decision", "restore", "shutdown", "evaluation", "startup")
        assert sum(res.breakdown[k] for k in pauses) == 0
    assert runs["bamboo"].initial_throughput < 0.9 * ref  # the redundant forward, before any fault
    # One starting plan: without a fault, every policy but checkpoint-restart (its writes) trains alike.
    for name in COMMON_START:
        assert runs[name].initial_throughput / runs["chameleon"].initial_throughput == pytest.approx(1.0, rel=1e-12)
        if name not in BLOCKING_WRITES:
            assert runs[name].throughput / runs["chameleon"].throughput == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("initial", ["planner", "recipe"])
def test_every_policy_starts_from_one_plan(initial):
    """The planner's fastest even plan on the whole cluster (the recipe's 4 × 8 with sim.initial=recipe), whose
    pipelines every baseline can replicate; Bamboo and Oobleck lay out the same cluster by their own rules."""
    cfg = compose_sim("trace=none", f"sim.initial={initial}")
    setup = prepare(cfg)[0]
    if initial == "recipe":
        assert setup.plan == build_plan(cfg) and setup.plan.dp == 4
    else:
        assert setup.plan == setup.planning.best_even([(d,) for d in range(32)], n_micro=256, micro_batch_size=1)
        assert setup.plan != setup.reference  # the reference may be uneven: no baseline could start from it
    assert {name: make_policy(name, setup).start() for name in COMMON_START} == dict.fromkeys(COMMON_START, setup.plan)
    assert set(make_policy("oobleck", setup).start().devices) == set(range(setup.n_devices))


def test_the_bare_command_simulates_faults(tmp_path):
    """``python -m chameleon.simulate`` as typed: the demonstration trace's faults hit every policy's plan within the
    horizon, and the policies recover differently."""
    proc = subprocess.run([sys.executable, "-m", "chameleon.simulate"], capture_output=True, text=True, timeout=120,
                          env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("trace=demo (each device fails every 24 h on average, back after 4 h): "), first
    summary = json.loads((Path(first.split("outputs in ")[1]) / "summary.json").read_text())
    faults = {r["policy"]: sum(x["kind"] == "fault" for x in r["recoveries"]) for r in summary["runs"]}
    assert faults.keys() == set(ALL) and min(faults.values()) >= 1, faults
    assert len({round(r["throughput"], 3) for r in summary["runs"]}) > 1


@pytest.mark.full  # over 5 s: the full suite
def test_reference_is_the_best_plan_on_the_cluster_so_no_ratio_exceeds_one():
    runs, setup, *_ = run_all("sim.initial=planner", "trace=oobleck", "trace.interval_s=1800", "trace.repair_h=1",
                              "sim.horizon_h=8")
    planning, units = setup.planning, [(d,) for d in range(32)]
    for n in range(16, 33):
        plan = planning.best(units[:n], n_micro=256, micro_batch_size=1)
        assert plan.global_batch / planning.t_step(plan) <= setup.reference_throughput * (1 + 1e-12)
    for res in runs.values():
        assert res.throughput <= res.reference_throughput
        assert all(r["post_over_reference"] <= 1 + 1e-9 for r in res.recoveries)
    first = next(r for r in runs["chameleon"].recoveries if r["kind"] == "fault")
    assert 0.95 < first["post_over_reference"] < 1  # 31 of 32 cards, re-planned


def test_checkpoint_writes_follow_young_daly():
    runs, setup, _, horizon = run_all("trace=none", "sim.horizon_h=6", policies=("checkpoint",))
    write = est.checkpoint_time(setup.planning.profile, setup.plan.n_layers)
    interval = math.sqrt(2 * write * setup.mtbf_s)
    n_writes = math.floor((horizon - interval) / (interval + write)) + 1
    assert runs["checkpoint"].breakdown["checkpoint"] == pytest.approx(n_writes * write, rel=1e-6)


@pytest.mark.full  # over 5 s: the full suite
@pytest.mark.parametrize("trace", [("trace=oobleck", "trace.interval_s=1800", "sim.horizon_h=8"),
                                   ("trace=poisson", "trace.device_mtbf_h=40", "trace.repair_h=1", "sim.horizon_h=12")])
def test_time_breakdown_sums_to_the_horizon(trace):
    runs, _, events, horizon = run_all(*trace)
    assert any(e.kind == "remove" for e in events)
    for res in runs.values():
        assert sum(res.breakdown.values()) == pytest.approx(horizon, rel=1e-9)
        assert all(v >= -1e-9 for v in res.breakdown.values())
        assert sum(e - s for s, e, _ in res.timeline) == pytest.approx(horizon, rel=1e-9)


@pytest.mark.full  # over 5 s: the full suite
def test_same_seed_same_result_other_seed_differs():
    a = run_all("trace=poisson", "trace.device_mtbf_h=40", "sim.horizon_h=6", policies=("chameleon", "torchft"))
    b = run_all("trace=poisson", "trace.device_mtbf_h=40", "sim.horizon_h=6", policies=("chameleon", "torchft"))
    c = run_all("trace=poisson", "trace.device_mtbf_h=40", "sim.horizon_h=6", "trace.seed=1", policies=("chameleon",))
    assert a[2] == b[2] and a[2] != c[2]
    assert [r.to_dict() for r in a[0].values()] == [r.to_dict() for r in b[0].values()]
    assert a[0]["chameleon"].samples != c[0]["chameleon"].samples


@pytest.mark.full  # over 5 s: the full suite
@pytest.mark.parametrize("interval, winner, loser", [(20, "reroute", "dynamic"), (21600, "dynamic", "reroute")])
def test_frequent_faults_favour_reroute_rare_ones_dynamic(interval, winner, loser):
    # Every data-parallel message costs 4 s to start: a re-plan fetches each unit a device lacks in one (tens of
    # seconds), a sync round pays it once a step, rerouting moves nothing. Faults every 20 s favour rerouting; every
    # 6 h repay the re-plan.
    setup, events, horizon, _ = setup_for(
        f"policy.mtbf_prior_s={interval}", "trace=oobleck", f"trace.interval_s={interval}", "trace.n_removals=3",
        f"sim.horizon_h={4 * interval / 3600}",
    )
    setup.planning = Planning(replace(setup.planning.profile, dp_latency_s=4.0), setup.policy)
    runs = {p: simulate(setup, p, events, horizon_s=horizon) for p in ("chameleon", "reroute", "dynamic", "oracle")}
    assert runs[winner].throughput > runs[loser].throughput
    for name in ("chameleon", "oracle"):
        assert {r["choice"] for r in runs[name].recoveries} == {winner}
        assert runs[name].throughput == pytest.approx(runs[winner].throughput)


@pytest.mark.full  # over 5 s: the full suite
def test_torchft_shrinks_the_batch_and_oobleck_idles_repaired_cards():
    runs, setup, *_ = run_all("trace=oobleck", "trace.interval_s=3600", "trace.n_removals=3", "trace.repair_h=1.5",
                              "sim.horizon_h=6", policies=("chameleon", "oobleck", "torchft"))
    drops = [r["post_over_reference"] for r in runs["torchft"].recoveries if r["choice"] == "drop_replica"]
    assert drops and all(r < 0.9 for r in drops)
    assert any(r["choice"] == "heal" for r in runs["torchft"].recoveries)
    assert all(r["kind"] == "fault" for r in runs["oobleck"].recoveries)  # no re-join handled
    assert any(r["choice"] == "rejoin" for r in runs["chameleon"].recoveries)
    assert runs["chameleon"].throughput > runs["oobleck"].throughput


def test_placement_is_the_hungarian_optimum():
    setup, *_ = setup_for("trace=none")
    plan, planning = setup.plan, setup.planning
    profile = planning.profile

    def units_of_stages(p):
        """Device → its stage's model units (−1 the embedding, n_layers the head), read off the plan (TP 1)."""
        return {st.devices[0]: set(range(*st.layers)) | ({-1} if s == 0 else set()) | ({p.n_layers} if s == q.n_stages - 1 else set())
                for q in p.pipelines for s, st in enumerate(q.stages)}

    held = units_of_stages(plan)
    size = {u: profile.first_params if u == -1 else profile.last_params if u == plan.n_layers else profile.layer_params
            for u in range(-1, plan.n_layers + 1)}
    for failed in ({5}, {0, 13}, {7, 8, 31}):
        units = geometry_of(plan).units(set(plan.devices) - failed)
        filled = planning.best(units, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size)
        placed = place(filled, plan, profile)
        slot_units = list(units_of_stages(filled).values())  # in stage order, as the units fill them
        groups = [u[0] for u in units]
        cost = np.array([[sum(size[u] * 12 for u in need - held.get(g, set())) for g in groups] for need in slot_units])
        rows, cols = linear_sum_assignment(cost)  # 12 bytes a parameter: fp32 weight and two moments
        assert est.migration_time(profile, plan, placed)[1] == pytest.approx(cost[rows, cols].sum())


def test_traces_round_trip_and_generators(tmp_path):
    events = oobleck_trace(n_nodes=30, interval_s=600, n_removals=15, node_size=2, seed=3)
    assert [e.time_s for e in events] == [600 * (i + 1) for i in range(15)]
    assert len({e.devices for e in events}) == 15 and all(len(e.devices) == 2 for e in events)
    path = write_csv(events + (Event(99_000.0, "add", (4, 5)),), tmp_path / "t.csv", node_size=2)
    assert path.read_text().splitlines()[0] == f"600000,remove,node{events[0].devices[0] // 2}"
    assert read_csv(path, node_size=2) == events + (Event(99_000.0, "add", (4, 5)),)
    (tmp_path / "h.csv").write_text("ms,event,node\n1500,remove,node7\n\n2500,add,node7\n")
    assert read_csv(tmp_path / "h.csv", node_size=1) == (Event(1.5, "remove", (7,)), Event(2.5, "add", (7,)))
    (tmp_path / "bad.csv").write_text("1500,explode,node7\n")
    with pytest.raises(ValueError, match="bad.csv:1"):
        read_csv(tmp_path / "bad.csv", node_size=1)
    trace = poisson_trace(n_devices=64, devices_per_node=8, horizon_s=1e6, device_mtbf_s=2e5, node_mtbf_s=5e5, repair_s=1e4, seed=0)
    assert trace == poisson_trace(n_devices=64, devices_per_node=8, horizon_s=1e6, device_mtbf_s=2e5, node_mtbf_s=5e5, repair_s=1e4, seed=0)
    down: dict[int, float] = {}
    for e in trace:
        for d in e.devices:
            if e.kind == "remove":
                assert d not in down
                down[d] = e.time_s
            else:
                assert e.time_s == pytest.approx(down.pop(d) + 1e4)
    assert any(len(e.devices) == 8 and e.kind == "remove" for e in trace)  # a whole node failed at once


@pytest.mark.full
def test_cli_multirun_and_sweep_table(tmp_path):
    cmd = [sys.executable, "-m", "chameleon.simulate", "--multirun", *BASE, "trace=oobleck", "trace.n_removals=2",
           "trace.interval_s=1800,3600", "sim.horizon_h=2", "sim.plots=true", "sim.policies=[chameleon,oobleck]",
           f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for job in ("0", "1"):
        summary = json.loads((tmp_path / job / "summary.json").read_text())
        assert [r["policy"] for r in summary["runs"]] == ["chameleon", "oobleck"]
        assert (tmp_path / job / "throughput.png").stat().st_size > 0 and (tmp_path / job / "breakdown.png").exists()
    out = subprocess.run([sys.executable, "-m", "chameleon.sim.report", str(tmp_path)], capture_output=True, text=True, env=ENV)
    rows = [line for line in out.stdout.splitlines() if "trace.interval_s=" in line]
    assert len(rows) == 4 and "| chameleon |" in rows[0]


@pytest.mark.parametrize(("dp", "pp", "tp", "failed"), [(2, 2, 2, {3, 6}), (2, 1, 4, {1, 6}), (2, 1, 3, {2, 3})])
def test_the_simulator_makes_the_runtimes_call_when_shards_of_two_replicas_survive(dp, pp, tp, failed):
    """The cases the fault tests run for real (tests/test_faults.py, tests/test_multinode.py): every stage replica of
    some layers lost a device, each shard lives on somewhere. The simulated Chameleon and the runtime's coordinator
    see the same truth (nothing lost, the survivors regrouped) and, given the same precomputed plan, decide alike."""
    from chameleon.decision.config import ClusterConfig, PolicyConfig
    from chameleon.decision.coordinator import Coordinator
    from chameleon.decision.profiler import analytic_profile
    from chameleon.layout.plan import even_plan
    from chameleon.model.config import ModelConfig
    from chameleon.sim.config import SimConfig
    from chameleon.sim.engine import Setup, make_policy
    from chameleon.sim.policies import Fault

    model = ModelConfig(dim=48, n_layers=6, n_heads=12, n_kv_heads=12, vocab_size=256)
    cluster = ClusterConfig(name="test", kind="analytic", n_devices=8, devices_per_node=8, peak_tflops=1.0,
                            memory_gb=1.0, hbm_gbps=100.0, intra_gbps=10.0, inter_gbps=1.0)
    profile = analytic_profile(model, cluster, micro_batch=1, seq_len=64, tp=tp)
    policy = PolicyConfig(fixed_d_s=3600.0)
    plan = even_plan(dp=dp, pp=pp, tp=tp, n_layers=6, global_batch=8, micro_batch=1)
    assert geometry_of(plan).lost(failed) == ()
    setup = Setup(Planning(profile, policy), plan, plan, policy, SimConfig(), mtbf_s=3600.0, n_devices=len(plan.devices),
                  tp_sizes=model.tp_sizes)
    simulated = make_policy("chameleon", setup).on_fault(plan, Fault(100.0, frozenset(failed), frozenset(failed), (), 1e9))
    alive = set(plan.devices) - failed
    units = geometry_of(plan).units(alive)
    precomputed = setup.planning.best(units, n_micro=plan.n_micro_batches, micro_batch_size=1, previous=plan)
    coordinator = Coordinator(model=model, profile=profile, planner=setup.planning.planner, policy=policy)
    real = coordinator.recover(plan, alive=alive, next_step=3, saved=None, now=100.0, fault_times=[], elapsed_s=100.0,
                               precomputed=precomputed)
    assert simulated.choice == real.decision.choice in {"dynamic", "redundant", "reform"}
    assert simulated.plan == real.plan and real.manifest is not None
    seat = geometry_of(plan).seat
    rebuilt = [u for u in units if len({seat[d][0] for d in u}) > 1]  # one unit of shards of two replicas
    assert len(rebuilt) == 1 and (pp > 1 or real.plan.devices == rebuilt[0] or real.decision.choice == "reform")
    assert real.decision.choice != "reform" or geometry_of(real.plan).exposure(None) == 0.0  # two holders kept
