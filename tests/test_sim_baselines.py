"""The baselines' models (chameleon/sim/baselines) on small cases worked by hand.

A toy profile makes the arithmetic visible: every layer costs 1 s forward and 2 s
backward per micro-batch, communication and the optimizer are free, creating a
process group takes 0.5 s, so a uniform 1F1B pipeline of ``p`` stages of ``n``
layers runs ``m`` micro-batches in ``(p + m − 1)·3n`` s.
"""

from __future__ import annotations

import math

import pytest

from chameleon.decision.config import PolicyConfig
from chameleon.decision.profiler import Profile
from chameleon.layout.plan import Pipeline, Plan, Stage, even_plan
from chameleon.sim.baselines import bamboo, oobleck, recycle
from chameleon.sim.config import SimConfig
from chameleon.sim.engine import Setup, make_policy
from chameleon.sim.policies import Fault, Planning, Rejoin
from chameleon.sim.traces import device_mtbf_h, oobleck_trace
from chameleon.sim.config import TraceConfig

BIG = 1e18


def toy_profile(n_layers: int = 4, **changes) -> Profile:
    fields = dict(
        key="toy", source="hand", n_layers=n_layers, micro_batch=1, seq_len=1, tp=1, layer_fwd_s=1.0, layer_bwd_s=2.0,
        first_fwd_s=0.0, first_bwd_s=0.0, last_fwd_s=0.0, last_bwd_s=0.0, layer_params=100, first_params=0,
        last_params=0, dtype="bf16", layer_act_bytes=1, first_act_bytes=0,
        last_act_bytes=0, boundary_bytes=0, memory_bytes=BIG, p2p_bw=BIG, p2p_latency_s=0.0, dp_bw=BIG,
        dp_latency_s=0.0, group_create_s=0.5, optimizer_s_per_param=0.0, checkpoint_bw=1200.0, restart_s=100.0,
        n_devices=8, devices_per_node=8,
    )
    return Profile(**{**fields, **changes})


def toy_setup(plan: Plan, profile: Profile | None = None, **sim) -> Setup:
    planning = Planning(profile or toy_profile(plan.n_layers), PolicyConfig())
    cfg = SimConfig()
    for key, value in sim.items():
        group, field = key.split("__")
        setattr(getattr(cfg, group), field, value)
    return Setup(planning, plan, plan, PolicyConfig(), cfg, mtbf_s=3600.0, n_devices=len(plan.devices))


def dp_plan(dp: int, n_micro: int, n_layers: int = 4) -> Plan:
    return even_plan(dp=dp, pp=1, tp=1, n_layers=n_layers, global_batch=n_micro, micro_batch=1)


# --- Oobleck -------------------------------------------------------------------------------------

def test_oobleck_template_time_follows_execution_result():
    # c = [1, 2, 1]: k* = 1; T1 = 4, T2 = (2·3 + 1 + 1)·2 = 16, T3 = 2 + 1 = 3.
    assert oobleck.oobleck_time([1.0, 2.0, 1.0]) == 23.0
    # A tie takes the later stage: c = [2, 2], k* = 1; T1 = 4, T2 = (4 + 1 + 1)·2 = 12, T3 = 2.
    assert oobleck.oobleck_time([2.0, 2.0]) == 18.0


def test_oobleck_batch_distribution_balances_time_per_stage():
    a = oobleck.Template(2, (1, 1), 4.0)  # T/S = 2
    b = oobleck.Template(3, (1, 1, 1), 12.0)  # T/S = 4
    # Level L = 10 / (2/2 + 1/4) = 8: nb_a = 4, nb_b = 2, and 2·4 + 2 = 10 exactly.
    assert oobleck.distribute_batch(10, {a: 2, b: 1}) == {a: (4, 4), b: (2,)}
    # Three equal pipelines cannot split 10 equally: Oobleck's solver fails; ours lets one take one more.
    assert oobleck.distribute_batch(10, {a: 3}) == {a: (4, 3, 3)}


def test_oobleck_reinstantiation_borrows_then_merges():
    # A 2-device pipeline borrows from the biggest one still above n0 = 3.
    assert oobleck.reinstantiate([(0, 2), (3, 4, 5, 6)], 3) == [(0, 2, 6), (3, 4, 5)]
    # Nobody can lend: the short pipeline merges into the next.
    assert oobleck.reinstantiate([(0, 1), (2, 3, 4)], 3) == [(0, 1, 2, 3, 4)]
    assert oobleck.reinstantiate([(0, 1, 2), (3, 4, 5)], 3) == [(0, 1, 2), (3, 4, 5)]


def test_oobleck_copy_is_the_first_holders_broadcast():
    # Old: two pipelines of 2 stages (layers 0-1 | 2-3). New: device 1 now holds layers 0-3 alone.
    profile = toy_profile(dp_bw=100.0)
    old = Plan(n_layers=4, micro_batch_size=1, pipelines=(
        Pipeline((Stage((0,), (0, 2)), Stage((1,), (2, 4))), 1), Pipeline((Stage((2,), (0, 2)), Stage((3,), (2, 4))), 1)))
    new = Plan(n_layers=4, micro_batch_size=1, pipelines=(
        Pipeline((Stage((1,), (0, 4)),), 1), Pipeline((Stage((2,), (0, 2)), Stage((3,), (2, 4))), 1)))
    # Device 1 lacks layers 0 and 1 (the embedding unit has no parameters): 2 × 100 params × 4 bytes (fp32 weights)
    # = 800 bytes, received by it and sent by device 2 (device 0 is gone): 800 / 100 B/s = 8 s.
    assert oobleck.copy_time(profile, old, new) == pytest.approx(8.0)


def test_oobleck_policy_reinstantiates_locally():
    # 8 cards, 4 layers; 5000 bytes per card fit 2 layers' state and their synced gradients' copy (2 × 100 params ×
    # (18 + 4) bytes) but not 4: n0 = 2. f = 1.
    plan = dp_plan(8, 16)
    policy = make_policy("oobleck", toy_setup(plan, toy_profile(memory_bytes=5000.0), oobleck__fault_threshold=1))
    start = policy.start()
    assert policy.n0 == 2 and sum(p.micro_batches for p in start.pipelines) == 16 and len(start.devices) == 8
    groups = list(policy.groups)
    victim = start.pipelines[0].stages[0].devices[0]
    response = policy.on_fault(start, Fault(10.0, frozenset({victim}), frozenset({victim}), (), 1e9))
    expected = oobleck.reinstantiate([tuple(n for n in g if victim not in n) for g in groups], 2)
    assert [tuple(sorted(p.devices)) for p in response.plan.pipelines] == [tuple(d for n in g for d in n) for g in expected]
    # World group + one per pipeline + one per layer unit (4 layers, embedding, head), 0.5 s each; the copy is free.
    assert response.pause_s == pytest.approx((1 + len(expected) + 6) * 0.5)


# --- ReCycle -------------------------------------------------------------------------------------

def pipelines(dp: int, pp: int, m: int) -> Plan:
    return even_plan(dp=dp, pp=pp, tp=1, n_layers=pp, global_batch=dp * m, micro_batch=1)


@pytest.mark.parametrize("dp, pp, m, expected", [
    (3, 2, 6, 27.0),   # hosts 0 and 2 take 3 of pipeline 1's 6: (6 + 3)·3 = 27 > 1F1B (2 + 6 − 1)·3 = 21
    (4, 2, 12, 48.0),  # 3 hosts take 4 each: (12 + 4)·3 = 48 > (2 + 12 − 1)·3 = 39
    (3, 4, 2, 15.0),   # the extra (2 + 1)·3 = 9 fits in the bubbles: the 1F1B step (4 + 2 − 1)·3 = 15
])
def test_recycle_step_is_the_busiest_device_or_the_1f1b_step(dp, pp, m, expected):
    from chameleon.decision.selector import reroute_plan

    healthy = pipelines(dp, pp, m)
    planning = Planning(toy_profile(pp), PolicyConfig())
    assert planning.t_step(healthy) == pytest.approx((pp + m - 1) * 3.0)
    victim = healthy.pipelines[1].stages[0].devices[0]
    rerouted = reroute_plan(healthy, {victim})
    assert recycle.recycle_step(planning, rerouted, healthy) == pytest.approx(expected)


def test_recycle_policy_reroutes_then_refills_on_rejoin():
    healthy = dp_plan(6, 18, n_layers=2)  # the fastest even plan on 6 cards: (1 + 3 − 1)·6 = 18 s a step
    setup = toy_setup(healthy)
    policy = make_policy("recycle", setup)
    start = policy.start()
    victim = start.pipelines[1].stages[0].devices[0]
    response = policy.on_fault(start, Fault(1.0, frozenset({victim}), frozenset({victim}), (), 1e9))
    assert response.choice == "reroute" and response.plan.reroutes
    assert response.t_step == pytest.approx(recycle.recycle_step(policy.planning, response.plan, start))
    back = policy.on_rejoin(response.plan, Rejoin(2.0, frozenset({victim}), frozenset(), (1.0,), 1e9))
    assert not back.plan.reroutes and back.t_step == pytest.approx(policy.planning.t_step(start))
    # Nothing rerouted and nothing faster to restart onto: the plan stays.
    assert policy.on_rejoin(back.plan, Rejoin(3.0, frozenset({99}), frozenset(), (1.0,), 1e9)) is None


def test_recycle_restarts_when_the_hosts_run_out_of_memory_and_grows_back():
    # 1000-byte activations, 4000 bytes per card: a stage holds 1800 bytes of state + 2 in flight, but not
    # the 2 more a host of a rerouted pipeline keeps. The 5 survivors restart on 2 pipelines × 2 stages.
    healthy = pipelines(3, 2, 6)
    policy = make_policy("recycle", toy_setup(healthy, toy_profile(2, layer_act_bytes=1000, memory_bytes=4000.0)))
    start = policy.start()
    victim = start.pipelines[1].stages[0].devices[0]
    response = policy.on_fault(start, Fault(1.0, frozenset({victim}), frozenset({victim}), (), 1e9))
    assert response.choice == "restart" and response.plan.dp == 2 and not response.plan.reroutes
    assert response.pause_s >= 100.0  # the relaunch
    grown = policy.on_rejoin(response.plan, Rejoin(2.0, frozenset({victim}), frozenset(), (1.0,), 1e9))
    assert grown.choice == "restart_bigger" and grown.plan.dp == 3 and grown.pause_s >= 100.0


# --- Bamboo --------------------------------------------------------------------------------------

def test_bamboo_hidden_share_and_shadow_memory():
    profile = toy_profile()
    assert bamboo.bubble_hidden(profile, 2, 8) == pytest.approx(3 / 8)  # (2 − 1)·3 / (8·1)
    assert bamboo.bubble_hidden(profile, 4, 2) == 1.0  # 3·3 / 2 > 1
    shadow = bamboo.redundant_profile(profile, hidden=0.25)
    assert shadow.layer_fwd_s == pytest.approx(1.75)
    # Own fp32 weights, gradients and Adam moments and bf16 copy (4+4+8+2) plus the shadow's weights and moments (4+8).
    assert profile.memory_costs.state_bytes_per_param == 18
    assert shadow.memory_costs.state_bytes_per_param == 18 + 12


def test_bamboo_fails_over_then_reconfigures_by_the_artifacts_rule():
    plan = dp_plan(8, 8)
    policy = make_policy("bamboo", toy_setup(plan))
    start = policy.start()
    # Depth 2, 4 pipelines: hidden = min(1, 1·3/(2·1)) = 1, step (2 + 2 − 1)·6 = 18 (pure DP has no neighbour).
    assert policy.depth == 2 and start.dp == 4 and policy.t_step(start) == pytest.approx(18.0)
    victim = start.pipelines[1].stages[1].devices[0]
    response = policy.on_fault(start, Fault(5.0, frozenset({victim}), frozenset({victim}), (), 1e9))
    # One overloaded card of 7 active: 2/7 > 5 % → reconfigure onto ⌊7/2⌋ = 3 pipelines after 450 s.
    assert response.choice == "failover+reconfigure" and response.pause_s == 450.0
    assert response.plan.dp == 3 and sorted(p.micro_batches for p in response.plan.pipelines) == [2, 3, 3]


def test_bamboo_failover_and_fatal_second_fault():
    plan = dp_plan(8, 8)
    policy = make_policy("bamboo", toy_setup(plan, bamboo__overload_threshold=1.0))
    start = policy.start()
    pipe = start.pipelines[1]
    victim, neighbour = pipe.stages[1].devices[0], pipe.stages[0].devices[0]
    response = policy.on_fault(start, Fault(5.0, frozenset({victim}), frozenset({victim}), (), 1e9))
    # The predecessor runs both stages (4 layers × 3 s × 2 micro-batches = 24 s) at no pause.
    assert response.choice == "failover" and response.pause_s == 0.0 and response.t_step == pytest.approx(24.0)
    dead = frozenset({victim, neighbour})
    fatal = policy.on_fault(response.plan, Fault(6.0, frozenset({neighbour}), dead, (5.0,), 1e9))
    assert fatal.choice == "fatal_restart" and fatal.pause_s == 30.0 and fatal.plan.dp == 3


# --- torchft, checkpoint, ElasWave ---------------------------------------------------------------

def test_torchft_drops_the_replica_and_heals_it():
    plan = dp_plan(4, 8)  # the fastest even plan: 4 replicas × 2 micro-batches, (1 + 2 − 1)·12 = 24 s
    policy = make_policy("torchft", toy_setup(plan))
    start = policy.start()
    assert start.dp == 4 and policy.t_step(start) == pytest.approx(24.0)
    response = policy.on_fault(start, Fault(1.0, frozenset({2}), frozenset({2}), (), 1e9))
    # 3 replicas keep 6 of 8 samples; the survivors wait the 60 s timeout, then build their one sync group: 0.5 s.
    assert response.plan.global_batch == 6 and response.pause_s == pytest.approx(60.5)
    healed = policy.on_rejoin(response.plan, Rejoin(2.0, frozenset({2}), frozenset(), (1.0,), 1e9))
    # Healing builds the one sync group again (0.5 s); the toy's state moves at no cost.
    assert healed.choice == "heal" and healed.plan.global_batch == 8 and healed.pause_s == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["torchft", "recycle"])
def test_replicating_baselines_refuse_unequal_pipelines(name):
    uneven = Plan(n_layers=4, micro_batch_size=1, pipelines=(
        Pipeline((Stage((0,), (0, 4)),), 4), Pipeline((Stage((1,), (0, 2)), Stage((2,), (2, 4))), 4)))
    with pytest.raises(ValueError, match=f"sim.policies: {name} needs equal pipelines but the starting plan's differ"):
        make_policy(name, toy_setup(uneven)).start()


def test_checkpoint_restarts_on_the_best_even_plan_of_the_survivors():
    plan = dp_plan(4, 8)
    policy = make_policy("checkpoint", toy_setup(plan))
    start = policy.start()
    response = policy.on_fault(start, Fault(1.0, frozenset({0}), frozenset({0}), (), 1e9))
    # 3 survivors: 2 replicas × 4 micro-batches = 48 s beats 1 × 3 stages (60 s) and 1 × 2 (54 s).
    assert response.rollback and response.t_step == pytest.approx(48.0) and response.plan.dp == 2
    # Relaunch 100 s + reload of 4 layers × 100 params × 12 bytes (weights and moments) at 1200 B/s = 4 s.
    assert response.pause_s == pytest.approx(104.0)
    # Card 0 repaired: write a checkpoint (4 s), relaunch (100 s), reload (4 s) onto all 4 replicas again.
    grown = policy.on_rejoin(response.plan, Rejoin(2.0, frozenset({0}), frozenset(), (1.0,), 1e9))
    assert grown.plan.dp == 4 and grown.pause_s == pytest.approx(108.0) and not grown.rollback


def test_elaswave_replans_for_a_second_and_grows_back():
    plan = dp_plan(4, 8)
    policy = make_policy("elaswave", toy_setup(plan))
    response = policy.on_fault(plan, Fault(1.0, frozenset({1}), frozenset({1}), (), 1e9))
    assert response.pause_s == 1.0 and sorted(response.plan.devices) == [0, 2, 3]
    assert response.t_step == pytest.approx(policy.planning.t_step(response.plan))
    grown = policy.on_rejoin(response.plan, Rejoin(2.0, frozenset({1}), frozenset(), (1.0,), 1e9))
    assert sorted(grown.plan.devices) == [0, 1, 2, 3] and grown.pause_s == 1.0


# --- Traces --------------------------------------------------------------------------------------

def test_llama3_rate_and_repaired_oobleck_trace():
    cfg = TraceConfig(incidents=419, incident_days=54, incident_devices=16384)
    assert device_mtbf_h(cfg) == pytest.approx(54 * 24 * 16384 / 419)  # ≈ 50,677 GPU-hours per fault
    with pytest.raises(ValueError, match="trace.incident_days"):
        device_mtbf_h(TraceConfig(incidents=419))
    events = oobleck_trace(n_nodes=4, interval_s=100, n_removals=6, node_size=1, seed=0, repair_s=150)
    down: dict[int, float] = {}
    for e in events:
        (d,) = e.devices
        if e.kind == "remove":
            assert d not in down and e.time_s % 100 == 0
            down[d] = e.time_s
        else:
            assert e.time_s == down.pop(d) + 150
    assert sum(e.kind == "remove" for e in events) == 6 and math.isclose(events[-1].time_s, 750.0)
