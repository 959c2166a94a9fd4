"""Fail-slow devices in the simulator: traces, the engine's per-device speed, Chameleon's reaction, the tolerate and
failstop baselines, and the time breakdown's parts.

The toy profile of ``test_sim_baselines`` makes the arithmetic visible: 4 replicas of 4 layers × 2 micro-batches
step in 24 s; a replica on a device twice as slow takes 48 s, and the step waits for it.
"""

from __future__ import annotations

import pytest

from chameleon.config import ConfigError
from chameleon.decision import estimator as est
from chameleon.report.breakdown import TIME_PARTS
from chameleon.sim.config import TraceConfig
from chameleon.sim.engine import simulate
from chameleon.sim.traces import Event, build_trace
from chameleon.simulate import check, prepare
from tests.test_sim import compose_sim
from tests.test_sim_baselines import dp_plan, toy_setup

HORIZON = 20_000.0
WINDOW = 4  # ft.slow_window, the default


def episode(start: float, length: float, *, device: int = 0, factor: float = 2.0) -> tuple[Event, ...]:
    return Event(start, "slow", (device,), factor), Event(start + length, "recover", (device,))


def run(name: str, events: tuple[Event, ...], **sim):
    return simulate(toy_setup(dp_plan(4, 8), **sim), name, events, horizon_s=HORIZON)


def test_a_slow_device_slows_a_tolerating_run_by_its_factor_during_the_episode_only():
    setup = toy_setup(dp_plan(4, 8))
    slow = est.estimate_step(setup.planning.profile, setup.plan, speeds={0: 2.0}).t_step
    assert slow / setup.planning.t_step(setup.plan) == pytest.approx(2.0)  # the step waits for the slow replica: 48 s instead of 24
    res = run("tolerate", episode(1000.0, 5000.0))
    assert res.recoveries == []
    full = 8 / 24.0
    assert res.samples == pytest.approx(full * (HORIZON - 5000.0) + full / 2 * 5000.0)
    assert [x for span in res.timeline for x in span] == pytest.approx(
        [0.0, 1000.0, full, 1000.0, 6000.0, full / 2, 6000.0, HORIZON, full])
    assert res.breakdown["degraded"] == pytest.approx(2500.0)  # half of the episode's steps' time


def test_chameleon_notices_after_its_window_reacts_and_beats_tolerate():
    events = episode(1000.0, 10_000.0)
    chameleon, tolerate = run("chameleon", events), run("tolerate", events)
    onset, back = chameleon.recoveries
    assert onset["kind"] == back["kind"] == "slow"
    assert onset["time_s"] == pytest.approx(1000.0 + WINDOW * 48.0)  # 4 steps at the slow pace
    assert onset["choice"] in ("rebalance", "relayer", "replan", "evict") and onset["t_step"] < 48.0
    assert back["failed"] == [] and back["time_s"] > 11_000.0  # back to speed: decided again
    assert chameleon.throughput > 1.1 * tolerate.throughput
    assert chameleon.throughput == pytest.approx(run("oracle", events).throughput, rel=0.01)


def test_failstop_restarts_without_the_slow_device_and_with_it_once_it_is_back():
    res = run("failstop", episode(1000.0, 10_000.0), failstop__detect_s=600.0)
    out, back = (r for r in res.recoveries if r["kind"] == "slow")
    assert out["choice"] == "restart_without_slow" and out["time_s"] == pytest.approx(1600.0) and out["failed"] == [0]
    assert out["pause_s"] >= 100.0  # the toy's relaunch, and a reload
    assert back["choice"] == "restart_bigger" and back["time_s"] == pytest.approx(11_000.0)
    assert res.breakdown["restore"] >= 2 * 100.0 and res.breakdown["redone"] > 0  # progress since the checkpoint lost
    assert res.throughput < run("chameleon", episode(1000.0, 10_000.0)).throughput


@pytest.mark.parametrize("name", ["chameleon", "failstop"])
def test_a_blip_shorter_than_the_detection_changes_nothing(name):
    blip, quiet = run(name, episode(1000.0, 100.0)), run("tolerate", episode(1000.0, 100.0))
    assert not any(r["kind"] == "slow" for r in blip.recoveries)
    if name == "chameleon":  # failstop differs from tolerate anyway: it writes blocking checkpoints
        assert blip.samples == pytest.approx(quiet.samples)


def test_breakdown_uses_the_time_parts_and_sums_to_the_horizon_for_every_policy():
    setup, events, horizon, sim = prepare(compose_sim("trace=poisson", "trace.device_mtbf_h=50", "trace.repair_h=1",
                                                      "trace.slow_rate_per_device_h=0.02", "sim.horizon_h=6",
                                                      "train.micro_batch=4"))  # fewer micro-batches: quicker decisions
    assert {e.kind for e in events} == {"remove", "add", "slow", "recover"}
    for name in sim.policies:
        res = simulate(setup, name, events, horizon_s=horizon)
        assert tuple(res.breakdown) == TIME_PARTS
        assert sum(res.breakdown.values()) == pytest.approx(horizon, rel=1e-9)
        assert all(v >= -1e-9 for v in res.breakdown.values())
        assert res.breakdown["evaluation"] == res.breakdown["startup"] == 0
        assert res.to_dict()["ettr"] == pytest.approx(res.breakdown["productive"] / horizon)
    torchft = simulate(setup, "torchft", events, horizon_s=horizon)
    assert torchft.breakdown["detection"] > 0  # its collective timeout


def test_slow_episodes_leave_the_faults_as_they_were_and_stay_in_range():
    cfg = TraceConfig(device_mtbf_h=200.0, repair_h=1.0, slow_rate_per_device_h=0.05)
    events = build_trace(cfg, n_devices=16, devices_per_node=8, horizon_s=200 * 3600)
    faults = build_trace(TraceConfig(device_mtbf_h=200.0, repair_h=1.0), n_devices=16, devices_per_node=8,
                         horizon_s=200 * 3600)
    assert tuple(e for e in events if e.kind in ("remove", "add")) == faults
    slow_since: dict[int, float] = {}
    for e in events:
        (d,) = e.devices if e.kind in ("slow", "recover") else (None,)
        if e.kind == "slow":
            assert d not in slow_since and 1.2 <= e.factor <= 3.0
            slow_since[d] = e.time_s
        elif e.kind == "recover":
            assert 30.0 <= e.time_s - slow_since.pop(d) <= 36_000.0
    assert sum(e.kind == "slow" for e in events) > 100


@pytest.mark.parametrize(("override", "key"), [
    ("trace.slow_factor=[0.5,2]", "trace.slow_factor"), ("trace.slow_duration_s=[60,30]", "trace.slow_duration_s"),
    ("trace.slow_rate_per_device_h=-1", "trace.slow_rate_per_device_h"),
    ("sim.failstop.detect_s=-5", "sim.failstop.detect_s"),
])
def test_bad_fail_slow_values_are_refused_with_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key) as err:
        check(compose_sim(override))
    assert "\n" not in str(err.value)


def test_the_falcon_trace_adds_slow_devices_to_llama3_faults():
    falcon = compose_sim("trace=falcon").trace
    assert falcon.incidents == 419 and falcon.slow_rate_per_device_h > 0
    assert list(falcon.slow_duration_s) == [30.0, 36_000.0]  # FALCON: tens of seconds to nearly ten hours
    for name in ("demo", "llama3", "poisson", "oobleck", "none"):
        assert compose_sim(f"trace={name}").trace.slow_rate_per_device_h == 0  # the others draw no slow device
