"""Estimator: Eq. 9 by hand, uneven 1F1B against an independent event simulation, Eq. 12/14, shared CPU cores."""

from __future__ import annotations

import heapq
import math
import random

import pytest

from dataclasses import replace

from chameleon.decision import estimator as est
from chameleon.decision.config import ClusterConfig
from chameleon.decision.profiler import Profile, TPTerms, analytic_profile, with_tensor_parallel
from chameleon.layout.plan import even_plan
from chameleon.model.config import ModelConfig


def tiny_profile(*, n_layers: int = 4, memory_gb: float = 1.0, **overrides) -> Profile:
    """An analytic profile of a small Llama on a made-up 2-node cluster."""
    cluster = ClusterConfig(
        name="test", kind="analytic", n_devices=16, devices_per_node=8, peak_tflops=1.0, mfu=0.5,
        memory_gb=memory_gb, hbm_gbps=100.0, intra_gbps=10.0, inter_gbps=1.0, latency_us=10.0,
    )
    model = ModelConfig(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=256)
    return replace(analytic_profile(model, cluster, micro_batch=1, seq_len=64, tp=1), **overrides)


def test_eq9_by_hand():
    # 4 stages, 8 micro-batches, t_f = 1, t_b = 2: (4 + 8 − 1) · 3 = 33.
    assert est.pipeline_time([1.0] * 4, [2.0] * 4, 8) == pytest.approx(33.0)
    assert est.symmetric_step(4, 8, 1.0, 2.0) == pytest.approx(33.0)
    # One stage runs its micro-batches back to back.
    assert est.pipeline_time([1.5], [2.5], 5) == pytest.approx(20.0)


def _event_simulation(fwd, bwd, n_micro):
    """Discrete-event run of 1F1B: each stage is a server taking the next op of its
    fixed schedule once that op's input has arrived (written from the schedule's
    definition, independently of the estimator's sweep)."""
    n = len(fwd)
    queues = []
    for s in range(n):
        warm = min(n - 1 - s, n_micro)
        q = [("F", m) for m in range(warm)]
        f_next, b_next = warm, 0
        while f_next < n_micro or b_next < n_micro:
            if f_next < n_micro:
                q.append(("F", f_next))
                f_next += 1
            if b_next < n_micro:
                q.append(("B", b_next))
                b_next += 1
        queues.append(q)
    ready = {}
    for m in range(n_micro):
        ready[("F", 0, m)] = 0.0
    free = [0.0] * n
    idx = [0] * n
    events = [(0.0, s) for s in range(n)]
    finish = 0.0
    while events:
        now, s = heapq.heappop(events)
        if idx[s] >= len(queues[s]):
            continue
        kind, m = queues[s][idx[s]]
        key = (kind, s, m)
        if key not in ready or free[s] > now:
            continue
        start = max(now, ready[key], free[s])
        end = start + (fwd[s] if kind == "F" else bwd[s])
        free[s] = end
        idx[s] += 1
        finish = max(finish, end)
        if kind == "F":
            nxt = ("F", s + 1, m) if s + 1 < n else ("B", s, m)
        else:
            nxt = ("B", s - 1, m) if s else None
        if nxt is not None:
            ready[nxt] = end
            heapq.heappush(events, (end, nxt[1]))
        heapq.heappush(events, (end, s))
    return finish


@pytest.mark.parametrize("seed", range(12))
def test_uneven_matches_event_simulation(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    fwd = [rng.uniform(0.5, 3.0) for _ in range(n)]
    bwd = [rng.uniform(0.5, 6.0) for _ in range(n)]
    m = rng.randint(1, 12)
    assert est.pipeline_time(fwd, bwd, m) == pytest.approx(_event_simulation(fwd, bwd, m))


def test_eq12_single_failure_reroute():
    from chameleon.decision.selector import reroute_plan

    prof = tiny_profile()
    plan = even_plan(dp=4, pp=2, tp=1, n_layers=prof.n_layers, global_batch=24, micro_batch=1)
    rr = reroute_plan(plan, {1})
    fwd, bwd = est.stage_cost(prof, 2, first=False, last=True)
    # Eq. 12: N_m / (N_dp − 1) extra slots of the lost stage.
    assert est.reroute_extra(prof, rr) == pytest.approx(6 / 3 * (fwd + bwd))
    two = reroute_plan(plan, {1, 2})
    f0, b0 = est.stage_cost(prof, 2, first=True, last=False)
    assert est.reroute_extra(prof, two, slots="sum") == pytest.approx(2 * (fwd + bwd) + 2 * (f0 + b0))
    assert est.reroute_extra(prof, two, slots="max") == pytest.approx(2 * max(fwd + bwd, f0 + b0))


def test_slowest_pipeline_sets_step_and_eq14_memory():
    prof = tiny_profile()
    plan = even_plan(dp=2, pp=2, tp=1, n_layers=prof.n_layers, global_batch=8, micro_batch=1)
    e = est.estimate_step(prof, plan)
    assert e.t_step == pytest.approx(max(e.pipelines) + e.sync + e.optimizer)
    assert e.sync_rounds == 1
    mem = est.memory_per_device(prof, plan)
    per_param = 4 + 4 + 8 + 2  # fp32 master and gradient, two fp32 moments, the bf16 copy (the cluster computes in bf16)

    def peak(params: int, acts: int, in_flight: int, work: int) -> float:
        """The state, plus the largest moment: every micro-batch in flight; the last backward beside the synced
        gradients' fp32 bucket copy; the update's fp32 denominator."""
        return params * per_param + max(in_flight * acts + work, acts + work + 4 * params, 4 * params)

    stage0 = peak(2 * prof.layer_params + prof.first_params, 2 * prof.layer_act_bytes + prof.first_act_bytes, 2, 0)
    stage1 = peak(2 * prof.layer_params + prof.last_params, 2 * prof.layer_act_bytes + prof.last_act_bytes, 1,
                  prof.head_work_bytes)
    assert prof.head_work_bytes > 0
    assert mem[0] == pytest.approx(stage0) and mem[1] == pytest.approx(stage1)


def test_uneven_sync_needs_rounds():
    from chameleon.layout.plan import plan_from_spec

    prof = tiny_profile()
    plan = plan_from_spec([{"layers": [2, 2], "micro_batches": 4}, {"layers": [1, 3], "micro_batches": 4}],
                          tp=1, n_layers=4, global_batch=8, micro_batch=1)
    _, rounds = est.sync_time(prof, plan)
    # buckets {emb,0}, {1}, {2,3,head}: {emb,0} and {1} share pipeline 0's stage 0, {1} and {2,3} pipeline 1's stage 1.
    assert rounds == 2


def test_cpu_share_stretches_steps_when_processes_outnumber_cores():
    from chameleon.layout.plan import Pipeline, Plan, Stage

    prof = tiny_profile()
    shared = replace(prof, host_cores=2.0)
    # 4 single-stage pipelines on 2 cores: all busy from the start, each at half a core.
    plan = even_plan(dp=4, pp=1, tp=1, n_layers=prof.n_layers, global_batch=8, micro_batch=1)
    assert est.estimate_step(shared, plan).t_step == pytest.approx(2 * est.estimate_step(prof, plan).t_step)
    # As many processes as cores: no stretch.
    two = even_plan(dp=2, pp=1, tp=1, n_layers=prof.n_layers, global_batch=8, micro_batch=1)
    assert est.estimate_step(shared, two).t_step == pytest.approx(est.estimate_step(prof, two).t_step)
    # The busiest node sets the stretch of sync and optimizer: devices 0..2 on node 0, 8 on node 1.
    spread = Plan(prof.n_layers, 1, (Pipeline((Stage((0,), (0, 2)), Stage((1,), (2, 4))), 4),
                                     Pipeline((Stage((2,), (0, 2)), Stage((8,), (2, 4))), 4)))
    assert est.estimate_step(shared, spread).cpu_share == pytest.approx(1.5)


@pytest.mark.parametrize("seed", range(6))
def test_shared_cores_between_free_cores_and_one_core(seed):
    from chameleon.layout.plan import plan_from_spec

    rng = random.Random(seed)
    prof = replace(tiny_profile(n_layers=6), devices_per_node=64)
    specs = []
    for _ in range(rng.randint(1, 3)):
        cuts = sorted(rng.sample(range(1, 6), rng.randint(0, 3)))
        specs.append({"layers": [b - a for a, b in zip([0] + cuts, cuts + [6])], "micro_batches": rng.randint(1, 6)})
    plan = plan_from_spec(specs, tp=1, n_layers=6, global_batch=sum(s["micro_batches"] for s in specs), micro_batch=1)
    costs = []
    for p in plan.pipelines:
        pairs = [est.stage_cost(prof, st.n_layers, first=s == 0, last=s == p.n_stages - 1) for s, st in enumerate(p.stages)]
        costs.append(([f for f, _ in pairs], [b for _, b in pairs]))
    # Cores for everyone: the slowest pipeline's 1F1B, from the independent event simulation.
    free = max(_event_simulation(f, b, p.micro_batches) for (f, b), p in zip(costs, plan.pipelines))
    assert est.shared_compute(replace(prof, host_cores=64.0), plan) == pytest.approx(free)
    # One core never idles while an op is ready: every op's work, back to back.
    work = sum(p.micro_batches * (sum(f) + sum(b)) for (f, b), p in zip(costs, plan.pipelines))
    assert est.shared_compute(replace(prof, host_cores=1.0), plan) == pytest.approx(work)


def _random_uneven_plan(rng: random.Random, n_layers: int, tp: int):
    from chameleon.layout.plan import plan_from_spec

    specs = []
    for _ in range(rng.randint(2, 4)):
        cuts = sorted(rng.sample(range(1, n_layers), rng.randint(0, min(3, n_layers - 1))))
        specs.append({"layers": [b - a for a, b in zip([0] + cuts, cuts + [n_layers])], "micro_batches": 1})
    return plan_from_spec(specs, tp=tp, n_layers=n_layers, global_batch=len(specs), micro_batch=1)


@pytest.mark.parametrize("seed", range(40))
def test_sync_rounds_are_the_runtimes(seed):
    """The estimator's sync is the runtime's: the rounds of the plan's layout, each as long as its largest group.

    The first case, pipelines [2, 2] and [1, 2, 1], is one the greedy colouring the
    estimator once had put in 3 rounds where the runtime runs 2.
    """
    from chameleon.layout.geometry import geometry_of, sync_rounds
    from chameleon.layout.plan import plan_from_spec
    from chameleon.model.llama import LLAMA

    rng = random.Random(seed)
    n_layers, tp = rng.randint(3, 7), 1 + seed % 2
    prof = tiny_profile(n_layers=n_layers, tp=tp)
    model = ModelConfig(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=256)
    if seed == 0:
        plan = plan_from_spec([{"layers": [2, 2], "micro_batches": 1}, {"layers": [1, 2, 1], "micro_batches": 1}],
                              tp=1, n_layers=4, global_batch=2, micro_batch=1)
        prof, model = tiny_profile(n_layers=4), replace(model, n_layers=4)
    else:
        plan = _random_uneven_plan(rng, n_layers, tp)
    rounds = sync_rounds(geometry_of(plan), LLAMA.layout(model, plan))
    seconds, n_rounds = est.sync_time(prof, plan)
    assert n_rounds == len(rounds)
    if seed == 0:
        assert n_rounds == 2
    if tp == 1:
        shapes = LLAMA.param_shapes(model)
        numel = lambda names: sum(math.prod(shapes[n]) for n in names)  # noqa: E731
        expected = sum(max(est.allreduce_time(prof, len(g.devices), numel(g.names)) for g in r) for r in rounds)
        assert seconds == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(8))
def test_rerouted_step_is_the_runtimes_schedule(seed):
    """Rerouted plans are timed by the runtime's merged action lists (``reroute_slots=schedule``).

    Without reroutes that is Eq. 11's slowest pipeline; with them, a host runs its own
    and the rerouted micro-batches, so the step lasts at least the busiest host's work
    and at most every op one after another — which is what one shared core gives.
    """
    from chameleon.decision.selector import reroute_plan
    from chameleon.layout.schedule import step_actions

    rng = random.Random(seed)
    prof = replace(tiny_profile(n_layers=6), devices_per_node=64)
    dp, pp = rng.randint(2, 4), rng.randint(2, 3)
    plan = even_plan(dp=dp, pp=pp, tp=1, n_layers=6, global_batch=dp * rng.randint(1, 4), micro_batch=1)
    assert est.schedule_time(prof, plan) == pytest.approx(max(est.estimate_step(prof, plan).pipelines))
    lost = rng.sample(range(pp), rng.randint(1, pp - 1))  # pipeline 0 loses these stages
    rr = reroute_plan(plan, {plan.pipelines[0].stages[s].devices[0] for s in lost})
    assert len(rr.reroutes) == len(lost)
    cost = {}
    for j, p in enumerate(rr.pipelines):
        for s, st in enumerate(p.stages):
            cost["F", j, s], cost["B", j, s] = est.stage_cost(prof, st.n_layers, first=s == 0, last=s == p.n_stages - 1)
    work = {d: sum(cost[a.kind, a.pipeline, a.stage] for a in acts) for d, acts in step_actions(rr).items()}
    total = sum(rr.pipelines[j].micro_batches * (cost["F", j, s] + cost["B", j, s])
                for j, p in enumerate(rr.pipelines) for s in range(p.n_stages))
    step = est.schedule_time(prof, rr)
    assert max(work.values()) - 1e-9 <= step <= total + 1e-9
    assert step > est.schedule_time(prof, plan)  # hosts run more than before
    assert est.shared_compute(replace(prof, host_cores=64.0), rr) == pytest.approx(step)
    assert est.shared_compute(replace(prof, host_cores=1.0), rr) == pytest.approx(total)
    assert est.estimate_step(prof, rr).t_step == pytest.approx(step + est.estimate_step(prof, rr).sync
                                                               + est.estimate_step(prof, rr).optimizer)


def test_other_jobs_slow_every_process_fairly():
    """``background_procs`` busy processes of other jobs take their fair share of the cores."""
    prof = replace(tiny_profile(), devices_per_node=64, host_cores=2.0)
    one = even_plan(dp=1, pp=1, tp=1, n_layers=prof.n_layers, global_batch=4, micro_batch=1)
    alone = est.shared_compute(prof, one)
    assert alone == pytest.approx(max(est.estimate_step(prof, one).pipelines))
    # 1 of ours + 3 others on 2 cores: each runs at 2/4 of a core.
    assert est.shared_compute(replace(prof, background_procs=3.0), one) == pytest.approx(2 * alone)
    assert est.cpu_share(replace(prof, background_procs=3.0), one) == pytest.approx(2.0)
    assert est.shared_compute(replace(prof, background_procs=0.5), one) == pytest.approx(alone)  # a core is free


def test_a_stage_of_another_tp_size_takes_that_sizes_tp_terms():
    base = tiny_profile(tp_terms=(TPTerms(2, 0.3, 0.5), TPTerms(4, 0.6, 0.9)))  # made-up TP terms of sizes 2 and 4
    at = {1: base, 2: with_tensor_parallel(base, 2), 4: with_tensor_parallel(base, 4)}
    assert at[4].layer_fwd_s == pytest.approx(base.layer_fwd_s / 4 + 0.6)
    assert at[2].layer_bwd_s == pytest.approx(base.layer_bwd_s / 2 + 0.5)
    for profile in at.values():  # whichever TP size the running plan has, a stage of size t is priced alike
        for tp, own in at.items():
            assert est.stage_cost(profile, 3, first=False, last=True, tp=tp) == pytest.approx(
                est.stage_cost(own, 3, first=False, last=True))
    analytic = tiny_profile(tp=2)  # no TP terms: the layer's compute alone, split
    assert est.stage_cost(analytic, 3, first=False, last=False, tp=1)[0] == pytest.approx(
        3 * 2 * analytic.layer_fwd_s + analytic.p2p_latency_s + analytic.boundary_bytes / analytic.p2p_bw)


def test_tp_waits_leave_the_cores_to_others():
    """While a TP mesh waits on its all-reduces with no thread on a core (the idle part of its TP terms), a mesh
    sharing its cores runs at full speed; the wait itself is not stretched."""
    base = replace(tiny_profile(n_layers=2), devices_per_node=64, host_cores=2.0)
    plan = even_plan(dp=2, pp=1, tp=2, n_layers=2, global_batch=2, micro_batch=1)  # 2 meshes of 2 on 2 cores

    def at(idle: float) -> Profile:  # the TP terms' ``idle`` part spent waiting
        return with_tensor_parallel(replace(base, tp_terms=(TPTerms(2, 0.4, 0.6, idle * 0.4, idle * 0.6),)), 2)

    fwd, bwd = est.stage_cost(at(0.5), 2, first=True, last=True)  # 2 layers: 0.4 s and 0.6 s of waits
    # Both meshes at once: their work at half a core's speed, then their waits side by side.
    assert est.shared_compute(at(0.5), plan) == pytest.approx(2 * (fwd - 0.4) + 0.4 + 2 * (bwd - 0.6) + 0.6)
    assert est.shared_compute(at(0.0), plan) == pytest.approx(2 * (fwd + bwd))  # all work: every op stretched
    assert est.shared_compute(at(0.0), plan) > est.shared_compute(at(0.5), plan) > est.shared_compute(at(1.0), plan)
    # Cores for everyone: the waits change nothing, the schedule's longest path.
    roomy = replace(at(0.5), host_cores=64.0)
    assert est.shared_compute(roomy, plan) == pytest.approx(est.schedule_time(roomy, plan))


def test_device_work_is_what_each_device_runs_in_the_step_s_action_lists():
    """Counted per stage, as the runtime's 1F1B lists would add it up action by action, reroute hosts included."""
    from chameleon.decision.selector import reroute_plan
    from chameleon.layout.schedule import step_actions

    prof = tiny_profile()
    plan = even_plan(dp=3, pp=2, tp=1, n_layers=prof.n_layers, global_batch=18, micro_batch=1)
    for layout in (plan, reroute_plan(plan, {1}), reroute_plan(plan, {0, 3})):
        cost = {(kind, j, s): (est.stage_cost(prof, st.n_layers, first=s == 0, last=s == p.n_stages - 1)[kind == "B"])
                for j, p in enumerate(layout.pipelines) for s, st in enumerate(p.stages) for kind in "FB"}
        listed = {d: sum(cost[a.kind, a.pipeline, a.stage] for a in actions)
                  for d, actions in step_actions(layout).items()}
        got = est.device_work(prof, layout)
        assert got.keys() == listed.keys()
        assert all(got[d] == pytest.approx(listed[d]) for d in listed), (got, listed)

