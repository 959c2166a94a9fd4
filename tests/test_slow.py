"""Fail-slow devices: the straggler verdict (persistent, against peers of the same layers), the estimator at
per-device speeds, micro-batches rebalanced by speed, and the Eq. 8 decision on slow devices."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future

import pytest
import torch
from conftest import SMALL_RUN, assert_nothing_lost, run_entry

from chameleon.config import FaultToleranceConfig
from chameleon.decision import estimator as est
from chameleon.decision.config import PolicyConfig
from chameleon.decision.planner import Planner
from chameleon.decision.selector import decide, decide_slow, relayered
from chameleon.faults.spec import FailureConfig, planned_faults
from chameleon.layout.plan import even_plan, validate_plan
from chameleon.runtime.control.reshape import Reshaper
from chameleon.runtime.control.stragglers import Stragglers
from chameleon.runtime.worker.device import SELF_TEST_RUNS, compute_clock, self_test
from tests.test_decision_estimator import tiny_profile

DP4 = even_plan(dp=4, pp=1, tp=1, n_layers=4, global_batch=16, micro_batch=1)  # 4 micro-batches per pipeline


def judge(stragglers: Stragglers, paces: list[dict[int, float]], role=None) -> list[dict[int, float]]:
    """The verdict after each step's paces (every device of one role unless ``role`` says otherwise)."""
    out = []
    for pace in paces:
        stragglers.observe(stragglers.slowdowns(pace, role or dict.fromkeys(pace, "layers 0-4")))
        out.append(dict(stragglers.slow))
    return out


def test_a_blip_shorter_than_the_window_is_no_straggler_and_a_persistent_one_is_found_at_the_window():
    healthy, slow = {0: 1.0, 1: 1.0, 2: 1.1, 3: 0.9}, {0: 1.0, 1: 3.0, 2: 1.1, 3: 0.9}
    blip = judge(Stragglers(ratio=1.5, window=4), [healthy, slow, slow, slow, healthy, healthy])
    assert all(v == {} for v in blip)
    verdicts = judge(Stragglers(ratio=1.5, window=4), [healthy, slow, slow, slow, slow])
    assert verdicts[3] == {} and verdicts[4] == {1: pytest.approx(3.0)}


def test_a_slow_device_is_back_after_a_window_below_the_ratio():
    s = Stragglers(ratio=1.5, window=3)
    slow, healthy = {0: 1.0, 1: 4.0, 2: 1.0}, {0: 1.0, 1: 1.0, 2: 1.0}
    verdicts = judge(s, [slow] * 3 + [healthy, {0: 1.0, 1: 2.0, 2: 1.0}, healthy, healthy, healthy])
    assert verdicts[2] == {1: 4.0}
    assert verdicts[5] == {1: 4.0}, "a window that still holds a slow step is not back"
    assert verdicts[7] == {}


def test_stages_of_different_cost_are_judged_against_their_own_peers():
    """dp2 × pp2: the model prices stage 1 low, so its devices' pace is 1.6 × stage 0's: no one is slow; a device
    of stage 1 at 3 × its peer is."""
    role = {0: "0-2", 2: "0-2", 1: "2-4", 3: "2-4"}
    even = {0: 1.0, 2: 1.0, 1: 1.6, 3: 1.6}
    assert judge(Stragglers(ratio=1.5, window=2), [even] * 3, role)[-1] == {}
    assert judge(Stragglers(ratio=1.5, window=2), [{**even, 3: 4.8}] * 3, role)[-1] == {3: pytest.approx(3.0)}


def test_a_device_with_no_peer_is_judged_against_its_own_pace_and_stays_slow_on_a_new_plan():
    s = Stragglers(ratio=1.5, window=2)
    role = {0: "0-1", 1: "1-2"}  # a pipeline without replicas: no device has a peer
    assert judge(s, [{0: 1.0, 1: 1.3}] * 2 + [{0: 1.0, 1: 3.9}] * 2, role)[-1] == {1: pytest.approx(3.0)}
    s.restart()  # a new plan: its baseline is taken anew while it is slow, at its known factor
    verdicts = judge(s, [{0: 1.0, 1: 3.9}] * 4 + [{0: 1.0, 1: 1.3}] * 2, role)
    assert verdicts[3] == {1: pytest.approx(3.0)} and verdicts[5] == {}


def test_a_lost_device_leaves_the_verdict():
    s = Stragglers(ratio=1.5, window=1)
    judge(s, [{0: 1.0, 1: 5.0, 2: 1.0}])
    s.forget({1})
    assert s.slow == {} and 1 not in s.history


def test_a_slow_stage_stretches_the_estimate_and_rebalancing_gives_it_fewer_micro_batches():
    prof = tiny_profile()
    even, slow = est.estimate_step(prof, DP4), est.estimate_step(prof, DP4, speeds={1: 3.0})
    assert slow.compute == pytest.approx(3 * even.compute) and slow.optimizer == pytest.approx(3 * even.optimizer)
    moved = est.rebalanced(prof, DP4, {1: 3.0})
    validate_plan(moved)
    counts = [p.micro_batches for p in moved.pipelines]
    assert sum(counts) == 16 and counts[1] < min(counts[0], counts[2], counts[3])
    assert [p.stages for p in moved.pipelines] == [p.stages for p in DP4.pipelines], "no state moves"
    assert est.estimate_step(prof, moved, speeds={1: 3.0}).compute < 0.6 * slow.compute
    assert est.rebalanced(prof, DP4, {}) == DP4


def test_the_decision_on_a_slow_device_weighs_tolerate_rebalance_replan_and_evict_by_eq8():
    prof = tiny_profile()
    policy = PolicyConfig(fixed_d_s=1e6)
    d = decide_slow(prof, DP4, {1: 3.0}, policy=policy, planner=Planner(prof), horizon_s=600.0)
    assert [c.name for c in d.candidates] == ["tolerate", "rebalance", "relayer", "replan", "evict"]
    assert all(c.feasible for c in d.candidates if c.name != "relayer"), "dp4: one stage per pipeline, no layer moves"
    by = {c.name: c for c in d.candidates}
    assert d.choice == max(d.candidates, key=lambda c: c.score).name != "tolerate"
    assert by["tolerate"].t_step > 1.5 * by[d.choice].t_step
    assert 1 not in by["evict"].plan.devices and by["tolerate"].transition == 0.0
    assert d.d_s == 600.0, "scored over the slowness's expected remaining time, not D"


def test_a_slow_stage_of_a_pipeline_is_given_fewer_layers():
    prof = tiny_profile(n_layers=8, layer_fwd_s=0.01, layer_bwd_s=0.02)  # compute-bound: layers are what costs
    plan = even_plan(dp=2, pp=2, tp=1, n_layers=8, global_batch=8, micro_batch=1)  # pipe0 on 0, 1; pipe1 on 2, 3
    moved = relayered(plan, {1: 3.0})
    assert [st.layers for st in moved.pipelines[0].stages] == [(0, 6), (6, 8)] and moved.pipelines[1] == plan.pipelines[1]
    d = decide_slow(prof, plan, {1: 3.0}, policy=PolicyConfig(fixed_d_s=1e6), planner=Planner(prof), horizon_s=600.0)
    by = {c.name: c for c in d.candidates}
    assert by["relayer"].feasible and by["relayer"].t_step < by["rebalance"].t_step < by["tolerate"].t_step


def test_back_to_speed_a_device_the_plan_leaves_idle_is_taken_back_in():
    prof = tiny_profile()
    three = even_plan(dp=3, pp=1, tp=1, n_layers=4, global_batch=12, micro_batch=1)  # devices 0, 1, 2
    d = decide_slow(prof, three, {}, policy=PolicyConfig(fixed_d_s=1e6), planner=Planner(prof), horizon_s=600.0,
                    idle={3})
    assert d.choice == "replan" and 3 in d.chosen.plan.devices
    assert not next(c for c in d.candidates if c.name == "evict").feasible


class Recorded:
    """Planning that keeps the requests submitted to it (none runs: each decision stays under way)."""

    def __init__(self):
        self.requests = []

    def submit(self, request) -> Future:
        self.requests.append(request)
        return Future()


def test_all_back_to_speed_is_decided_on_only_where_the_plan_was_chosen_knowing_of_slow_devices():
    """A blip found slow on a healthy job (a busy host) and decided on without a move: its end has nothing to undo,
    and re-plans nothing. On a plan that started while a device was slow, its return is decided on (a move back may
    pay)."""
    planning = Recorded()
    reshaper = Reshaper(FaultToleranceConfig(slow_window=2), planning, emit=lambda _: None)
    reshaper.resident(tiny_profile(), DP4)

    def steps(first: int, slow: dict[int, float]) -> None:
        for step in (first, first + 1):
            reshaper.judge(step, tuple((d, reshaper.work[d] * slow.get(d, 1.0)) for d in DP4.devices), float(step))
            reshaper.consider(DP4, next_step=step + 1, times=[1.0], now=float(step), parcel=None, context=dict)

    steps(0, {1: 3.0})
    assert reshaper.slow == {1: pytest.approx(3.0)} and len(planning.requests) == 1
    reshaper.cancel()  # decided: nothing moved
    steps(2, {})
    assert reshaper.slow == {} and len(planning.requests) == 1, "nothing to undo"
    steps(4, {1: 3.0})
    assert len(planning.requests) == 2
    reshaper.cancel()
    reshaper.resident(tiny_profile(), DP4)  # a generation begun while device 1 is slow: chosen knowing of it
    steps(6, {})
    assert reshaper.slow == {} and len(planning.requests) == 3 and planning.requests[-1].kwargs["speeds"] == {}


@pytest.mark.parametrize("override, key", [({"factor": 0.5}, "failure.factor=0.5"), ({"rank": 9}, "failure.rank=9"),
                                           ({"duration_s": -1.0}, "failure.duration_s=-1.0"),
                                           ({"phase": "forward"}, "a step or at_s, no phase")])
def test_a_nonsense_slow_fault_is_refused_naming_its_key(override, key):
    cfg = FailureConfig(**{"kind": "slow", "rank": 1, "step": 3, **override})
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        planned_faults(cfg, world=4)


def test_a_device_is_timed_on_its_own_clock_and_a_slow_one_counts_its_stretch():
    cpu = torch.device("cpu")
    clock = compute_clock(cpu)
    start = clock()
    time.sleep(0.05)
    assert clock() - start < 0.01, "waiting (for a core, or for a peer) is not computing"
    took = []
    best = self_test(cpu, lambda s: took.append(s) or 3 * s)
    assert len(took) == SELF_TEST_RUNS and best == 3 * min(took) > 0


class _StreamEvent:
    """A stand-in for an accelerator's timing event (none here): ``record`` notes the host clock, as a stream
    would reach the event; ``synchronize`` is counted, as it would stall the host."""

    synchronized = 0

    def __init__(self, device_type: str, *, enable_timing: bool):
        assert device_type == "cuda" and enable_timing

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        _StreamEvent.synchronized += 1

    def elapsed_time(self, end: _StreamEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch's events give them


def test_an_accelerator_is_timed_by_events_read_after_the_step_and_waits_only_when_paced(monkeypatch):
    from chameleon.runtime.worker.schedule import _Busy

    monkeypatch.setattr(torch, "Event", _StreamEvent)
    busy = _Busy(None, torch.device("cuda"))
    for _ in range(3):
        with busy:
            time.sleep(0.01)
    assert _StreamEvent.synchronized == 0, "timing a step's compute must not stall the host"
    assert 0.03 <= busy.seconds < 0.3
    paced = _Busy(lambda s: 4 * s, torch.device("cuda"))
    with paced:
        time.sleep(0.01)
    assert _StreamEvent.synchronized == 1 and 0.04 <= paced.seconds < 0.4


SLOW_RUN = (*SMALL_RUN, "train.steps=16", "train.micro_batch=1")  # 8 micro-batches: 2 per pipeline of dp4


@pytest.fixture(scope="module")
def slow_reference(tmp_path_factory):
    """The single-process reference of SLOW_RUN."""
    run = run_entry("train", tmp_path_factory.mktemp("ref_slow") / "run", *SLOW_RUN, "launcher.nproc_per_node=1")
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.full
def test_a_persistent_straggler_is_found_within_the_window_and_trained_around_with_nothing_lost(tmp_path,
                                                                                               slow_reference):
    """Device 1 of dp4 computes 4 × slower from step 2 on (real workers, the slowness a real stretch of its
    forwards and backwards). Judged over 3 steady steps, it is found by step 6, a plan that trains around it is
    chosen by Eq. 8 and switched to at a step boundary, and the run ends at the failure-free losses, samples and
    parameters."""
    run = run_entry("train", tmp_path / "run", *SLOW_RUN, "launcher.nproc_per_node=4", "failure=slow",
                    "failure.rank=1", "failure.step=2", "failure.factor=4", "ft.slow_window=3")
    got = assert_nothing_lost(run, slow_reference)
    log = [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]
    (found,) = [e for e in log if e["event"] == "slow"]
    assert found["step"] <= 6 and set(found["slow"]) == {"1"} and found["slow"]["1"] > 1.5
    (decided,) = [e for e in log if e["event"] == "reshape"]
    chosen = decided["decision"]["choice"]
    assert chosen in ("rebalance", "replan", "evict"), decided["decision"]
    (reshape,) = got["reshapes"]
    assert reshape["chosen"] == chosen and reshape["first_step_s"] > 0
    assert "chameleon: after step" in run.stderr and "slow devices: 1 (×" in run.stderr
    assert got["generations"] == 2 and got["recoveries"] == []


@pytest.mark.full
def test_with_ft_slow_off_a_straggler_is_tolerated_and_nothing_is_judged(tmp_path, slow_reference):
    run = run_entry("train", tmp_path / "run", *SLOW_RUN, "launcher.nproc_per_node=4", "failure=slow",
                    "failure.rank=1", "failure.step=2", "failure.factor=4", "ft.slow_window=3", "ft.slow=off")
    got = assert_nothing_lost(run, slow_reference)
    assert got["reshapes"] == [] and got["generations"] == 1 and "slow devices" not in run.stderr


def test_random_faults_may_be_slow_devices_fired_at_their_time():
    cfg = FailureConfig(kind="random", kinds=["slow", "kill"], max_faults=6, mtbf_s=1.0, factor=2.5, duration_s=9.0)
    faults = planned_faults(cfg, world=4)
    slow = [f for f in faults if f.kind == "slow"]
    assert slow and all(f.at_s is not None and f.step is None and (f.factor, f.duration_s) == (2.5, 9.0) for f in slow)


@pytest.mark.full
def test_a_random_slow_device_is_paced_from_its_time_and_nothing_is_lost(tmp_path, slow_reference):
    run = run_entry("train", tmp_path / "run", *SLOW_RUN, "launcher.nproc_per_node=4", "failure=random",
                    "failure.kinds=[slow]", "failure.max_faults=1", "failure.mtbf_s=0.02", "failure.factor=4")
    assert_nothing_lost(run, slow_reference)
    log = [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]
    (injected,) = [e for e in log if e["event"] == "injected"]  # its moment: 37 ms into training (seeded)
    assert injected["fault"].startswith("slow (×4) of device ")


def test_a_fault_is_decided_at_the_slow_devices_pace():
    """A device lost while another is slow: every candidate is estimated at the slow device's pace."""
    prof, policy = tiny_profile(), PolicyConfig(fixed_d_s=1e6)
    even = decide(prof, DP4, {0}, policy=policy, planner=Planner(prof))
    slow = decide(prof, DP4, {0}, policy=policy, planner=Planner(prof), speeds={2: 3.0})
    for a, b in zip(even.candidates, slow.candidates, strict=True):
        if a.feasible and 2 in a.plan.devices:
            assert b.t_step > a.t_step, a.name
