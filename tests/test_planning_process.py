"""The planner's work and the recovery decisions in a child process (chameleon/runtime/control/offload.py): the same
decisions as in threads, a search's error as its future's, a child killed is one clear error within seconds (alone
and under a real run), and no process left behind."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from chameleon.decision.profiler import load_profile
from chameleon.runtime.control.core import Core
from chameleon.runtime.control.offload import OWN_NODE, PROCESS_NAME, InChild, Moved, PlanningDied, light
from chameleon.runtime.control.planning import (
    Grow,
    InThreads,
    Parcelling,
    Precompute,
    Recover,
    Request,
    Reshape,
    collect_unless_paused,
    collector_paused,
    reframed,
)
from chameleon.runtime.node.processes import forkserver
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.messages import parcel
from chameleon.runtime.protocol.errors import TrainingError
from conftest import ENV
from test_core import FakeClock, Inline, config

RESULT_S = 120.0  # a child's first result waits for its imports (torch) on a loaded 2-core machine


def _core(*overrides: str) -> Core:
    cfg, plan = config(*overrides)
    profile = load_profile(cfg.model, cfg.cluster, micro_batch=2, seq_len=cfg.train.seq_len, tp=1)
    return Core(cfg, plan=plan, profile=profile, run_dir="/run", store_port=1234, ckpt_root=Path("/run/ckpt"),
                saved=None, faults=[], fired=[], planner=Inline(), decider=Inline(), clock=FakeClock())


TIMED = ("transition", "transition_parts", "score")  # a candidate's search time is measured: it differs run to run


def _decided(decision) -> dict:
    out = decision.to_dict()
    out["candidates"] = [{k: v for k, v in c.items() if k not in TIMED} for c in out["candidates"]]
    return out


def _outcome(value) -> tuple:
    """What a request's result decides, comparably: the decision, the plan, members, the manifest's size, node 0's
    Moves, and every node's frame (each node's part of the manifest, encoded: the whole manifest, partitioned)."""
    outcome, parcels = value
    sends = None if parcels is None else {n: payload for n, (_, payload) in sorted(parcels.sends.items())}
    own = None if parcels is None else parcels.sends[OWN_NODE][0]
    if not hasattr(outcome, "plan"):
        return _decided(outcome), None, None, None, own, sends
    size = None if outcome.manifest is None else tuple(outcome.manifest.round_bytes)
    return _decided(outcome.decision), outcome.plan, outcome.members, size, own, sends


def _light_as_sent(value) -> None:
    """A transition from the child came back light: its manifest a stand-in, Moves objects for node 0 alone."""
    outcome, parcels = value
    if getattr(outcome, "manifest", None) is None:
        return
    assert isinstance(outcome.manifest, Moved)
    assert parcels.sends[OWN_NODE][0] is not None
    assert all(moves is None for node, (moves, _) in parcels.sends.items() if node != OWN_NODE)


def _requests(core: Core) -> list:
    plan, topology = core.first_plan, core.topology
    context = {"fault_times": [5.0], "elapsed_s": 50.0, "saved": None, "now": 1050.0}
    devices = set(plan.devices)
    return [
        Precompute(7, plan, frozenset(core._likely_losses()), frozenset()),
        Recover(plan, 7, Parcelling(1, topology), {"alive": devices - {3}, "next_step": 3, **context}),
        Recover(plan, 7, Parcelling(1, topology), {"alive": devices - {2, 3}, "next_step": 3, **context}),
        Recover(plan, None, Parcelling(1, topology), {"alive": devices - {0}, "next_step": 2, **context}),
        Reshape(plan, Parcelling(1, topology), {"alive": devices, "speeds": {1: 3.0}, "step_s": 1.0,
                                               "horizon_s": 600.0, **context}),
    ]


def test_the_child_decides_as_the_threads_do():
    """Each kind of request, in the controller's own threads and in the child process: the same decisions, plans,
    manifests and encoded moves (the precompute the recoveries and the growth place from stays in the child)."""
    core = _core("policy.name=dynamic", "launcher.nnodes=3", "parallel.dp=3", "parallel.pp=2",
                 "train.global_batch=12")
    threads = InThreads(ThreadPoolExecutor(1), ThreadPoolExecutor(1))
    threads.model(core.cost, *core.cost.build())
    child = InChild(forkserver())
    try:
        child.model(core.cost, None, None)
        here = [threads.submit(r) for r in _requests(core)]
        there = [child.submit(r) for r in _requests(core)]
        assert here[0].result() == there[0].result(RESULT_S) == 7
        for mine, theirs in zip(here[1:], there[1:], strict=True):
            assert _outcome(mine.result()) == _outcome(theirs.result(RESULT_S))
            _light_as_sent(theirs.result())
        (recovered, _) = there[1].result()
        assert recovered.decision.choice and recovered.manifest is not None
        assert any(key < 0 for _, key in child._plans.values()), "the child keeps its decided plan by key"
        # on from each side's own recovered plan (the child's goes back by key: it finds its own object): the
        # precompute for it, a growth onto the device back, another loss
        outcomes = []
        for planning, (transition, _) in ((threads, here[1].result()), (child, there[1].result())):
            resident = transition.plan
            context = {"fault_times": [5.0], "elapsed_s": 60.0, "saved": None, "now": 1060.0}
            alive = set(resident.devices)
            futures = [planning.submit(r) for r in (
                Precompute(8, resident, frozenset({1, 2}), frozenset({3})),
                Grow(resident, 8, Parcelling(2, core.topology), {"joining": {3}, "alive": alive, **context}),
                Recover(resident, None, Parcelling(2, core.topology), {"alive": alive | {3}, "next_step": 4,
                                                                       **context}))]
            outcomes.append([futures[0].result(RESULT_S), *(_outcome(f.result(RESULT_S)) for f in futures[1:])])
            if planning is child:
                for f in futures[1:]:
                    _light_as_sent(f.result())
        assert outcomes[0] == outcomes[1]
        assert outcomes[1][1][0]["choice"] == "grow", "the growth is decided, not merely declined"
    finally:
        child.close()
        threads.lanes["planner"].shutdown()
        threads.lanes["decider"].shutdown()
    assert not child.process.is_alive()


def test_moves_encoded_for_a_generation_that_came_first_are_encoded_again():
    """Parcels of a generation another one came before are encoded for the new one from their frames (the manifest
    of a child's transition never comes back): the same frames and Moves as the manifest's own for it, whether
    the parcels carry every node's Moves (decided in a thread) or node 0's alone (sent back light). (What parts
    share is packed once per parcelling, so frames packed apart may number it differently: they decode the same.)"""
    core = _core("policy.name=dynamic", "launcher.nnodes=3", "parallel.dp=3", "parallel.pp=2",
                 "train.global_batch=12")
    threads = InThreads(ThreadPoolExecutor(1), ThreadPoolExecutor(1))
    threads.model(core.cost, *core.cost.build())
    try:
        plan, topology = core.first_plan, core.topology
        decided = threads.submit(Recover(plan, None, Parcelling(1, topology), {
            "alive": set(plan.devices) - {3}, "next_step": 3, "fault_times": [5.0], "elapsed_s": 50.0,
            "saved": None, "now": 1050.0})).result()
    finally:
        threads.lanes["planner"].shutdown()
        threads.lanes["decider"].shutdown()
    transition, parcels = decided
    assert transition.manifest is not None and parcels.generation == 1
    own = parcel(transition.manifest, generation=4, nodes=range(topology.nnodes), node_of=topology.node_of)
    for sent in (parcels, light(decided)[1]):
        again = reframed(sent, 4)
        assert again.generation == 4
        assert {n: codec.decode(p) for n, (_, p) in again.sends.items()} == \
            {n: codec.decode(p) for n, (_, p) in own.sends.items()}
        assert {n: m for n, (m, _) in again.sends.items()} == {n: m for n, (m, _) in own.sends.items()}
    moved = light(decided)[0].manifest
    assert (moved.wire_bytes, moved.round_bytes) == (transition.manifest.wire_bytes, transition.manifest.round_bytes)


@dataclass(frozen=True)
class Collecting(Request):
    """Whether Python's cyclic collector runs while a request runs."""

    resident: None = None

    def run(self, shop) -> bool:
        return gc.isenabled()


def test_requests_run_with_the_collector_paused_and_it_runs_again_after():
    """Both lanes may overlap (and a decision pauses it too): the collector runs again once no request runs, a
    raise included."""
    assert InThreads(Inline(), Inline()).submit(Collecting()).result() is False
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collector_paused():
            with collector_paused():  # the other lane's request
                assert not gc.isenabled()
            assert not gc.isenabled(), "one request still runs"
            raise RuntimeError("a search that raises")
    assert gc.isenabled()


def test_what_a_pause_deferred_is_collected_after_it_not_during_another():
    """The planning process collects after each result it sends (its next request no longer pays for it), unless
    the other lane's request still runs."""

    class Cycle:
        pass

    def garbage() -> weakref.ref:
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        return weakref.ref(a)

    with collector_paused():
        cycle = garbage()
        collect_unless_paused()
        assert cycle() is not None, "no collection while a request runs"
    collect_unless_paused()
    assert cycle() is None


def test_a_search_that_raises_is_its_futures_error_and_the_child_goes_on():
    """A search's error is its future's (as in a thread); a signal meant for the controller leaves it be."""
    core = _core()
    child = InChild(forkserver())
    try:
        child.model(core.cost, None, None)
        plan = core.first_plan
        nobody = Recover(plan, None, Parcelling(1, core.topology), {"alive": set(), "next_step": 3, "fault_times": [],
                                                                     "elapsed_s": 1.0, "saved": None, "now": 1.0})
        with pytest.raises(Exception, match="no recovery is possible") as err:
            child.submit(nobody).result(RESULT_S)
        assert not isinstance(err.value, PlanningDied)
        assert child.submit(Precompute(1, plan, frozenset({1}), frozenset())).result(RESULT_S) == 1
        for signum in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C or a preemption is the controller's to handle
            os.kill(child.process.pid, signum)
        assert child.submit(Precompute(2, plan, frozenset({1}), frozenset())).result(RESULT_S) == 2
        child.check()
    finally:
        child.close()


def test_a_killed_child_is_one_clear_error_not_a_hang():
    """Killed under way: the decision waiting on it fails at once with what happened, and so does any later one;
    the event loop is woken to see it."""
    core = _core("policy.name=dynamic")
    child = InChild(forkserver())
    try:
        child.model(core.cost, None, None)
        plan = core.first_plan
        assert child.submit(Precompute(1, plan, frozenset({1}), frozenset())).result(RESULT_S) == 1
        waiting = [child.submit(Precompute(n, plan, frozenset({1, 2}), frozenset())) for n in range(2, 40)]
        os.kill(child.process.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(PlanningDied) as err:
            for future in waiting:
                future.result(10.0)
        assert time.monotonic() - started < 10.0
        said = str(err.value)
        assert said.startswith("planning failed: the planning process") and "signal 9" in said, said
        assert isinstance(err.value, TrainingError) and "\n" not in said
        with pytest.raises(PlanningDied):
            child.check()
        with pytest.raises(PlanningDied):
            child.submit(Precompute(99, plan, frozenset({1}), frozenset())).result(1.0)
        assert os.read(child.woken, 16), "the loop is woken"
    finally:
        child.close()
    assert not child.process.is_alive()


def _descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid``, with its name."""
    parent, name = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            name[int(entry.name)] = stat[stat.index("(") + 1:stat.rindex(")")]
    below, frontier = {}, {pid}
    while frontier:
        frontier = {p for p, up in parent.items() if up in frontier}
        below.update({p: name[p] for p in frontier})
    return below


@pytest.mark.full
def test_a_planning_process_killed_mid_run_ends_the_run_with_one_line(tmp_path):
    """A real run (two workers on CPU) whose planning child is SIGKILLed once training runs: the controller stops
    within seconds, says so in one line, and leaves no process behind."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", "output.progress=false",
           "train.steps=400", "model.dim=64", "model.n_layers=2", "train.global_batch=8", "train.micro_batch=2",
           "train.seq_len=32", "failure=none", "parallel=dp", "launcher.nproc_per_node=2", "ckpt=none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        (planning,) = [pid for pid, name in _descendants(proc.pid).items() if name == PROCESS_NAME]
        os.kill(planning, signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0
    said = [line for line in err.splitlines() if "planning failed" in line]
    assert len(said) == 1 and "exited with code -9 (signal 9)" in said[0], err[-3000:]
    assert took < 30, took
    from benchmarks._processes import lingering

    time.sleep(1.0)
    assert not lingering(proc.pid)
