"""The manifest executor with real gloo processes: A → B → C → A is bit-exact; faults abandon it fast."""

from __future__ import annotations

import os
import queue
import time
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chameleon.layout.plan import even_plan, plan_from_spec
from chameleon.layout.relayout import relabel_plan, relayout
from chameleon.layout.spec import layout_of
from chameleon.model.config import ModelConfig
from chameleon.model.llama import TP_RULES, param_shapes, stage_param_names
from chameleon.runtime.worker.comm import Generation, PeerFailure
from chameleon.runtime.worker.transfer import execute_manifest

WORLD = 4
CFG = ModelConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=20, multiple_of=8)
SHAPES = param_shapes(CFG)
NAMES = partial(stage_param_names, CFG)
KINDS = ("param", "exp_avg", "exp_avg_sq")
FAULT_DEADLINE_S = 0.5
FAULT = "fault"  # this test plays the controller: its flag lives in the store


def originals() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {kind: {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()} for kind in KINDS}


def transitions():
    """A (dp2·pp2) → B (device 1 dies: one 3-stage pipeline) → C (device 1 back, empty: pp2·tp2) → A.

    The fourth manifest, A with its devices swapped pairwise, is the one interrupted by a fault.
    """
    plan_a = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1)
    layout_a = layout_of(plan_a, SHAPES, NAMES, rules=TP_RULES)
    slots_b = plan_from_spec(
        [{"layers": [1, 2, 1], "micro_batches": 4}], tp=1, n_layers=4, global_batch=4, micro_batch=1
    )
    layout_b = layout_of(relabel_plan(slots_b, {0: 0, 1: 2, 2: 3}), SHAPES, NAMES, rules=TP_RULES)
    a_to_b = relayout(layout_a, layout_b, survivors=(0, 2, 3))
    slots_c = even_plan(dp=1, pp=2, tp=2, n_layers=4, global_batch=4, micro_batch=1)
    layout_c = layout_of(slots_c, SHAPES, NAMES, rules=TP_RULES)
    b_to_c = relayout(layout_b, layout_c, survivors=range(WORLD))
    c_to_a = relayout(layout_c, layout_a, survivors=range(WORLD))
    swapped = layout_of(relabel_plan(plan_a, {0: 1, 1: 0, 2: 3, 3: 2}), SHAPES, NAMES, rules=TP_RULES)
    return a_to_b, b_to_c, c_to_a, relayout(layout_a, swapped, survivors=range(WORLD))


def box(region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def mismatches(state, manifest, me, truth) -> list[str]:
    """What differs between ``me``'s state and the true regions the manifest's new layout gives it."""
    after = manifest.after.get(me, {})
    bad = [f"device {me}: holds {sorted(state[k])} not {sorted(after)}" for k in KINDS if set(state[k]) != set(after)]
    for kind in KINDS:
        for name, region in after.items():
            if not torch.equal(state[kind][name], truth[kind][name][box(region)]):
                bad.append(f"device {me}: {kind} {name} differs")
    return bad


def worker(rank: int, port: int, results, release) -> None:
    """Run the transitions and the fault on one rank; report through ``results``, then exit at once."""
    try:
        report = run_rank(rank, port, release)
    except BaseException as err:  # reported to the parent, which fails the test with it
        report = (rank, [f"device {rank}: {err!r}"], "crashed", -1, [])
    results.put(report)
    results.close()
    results.join_thread()
    os._exit(0)  # an abandoned receive still blocks on this group: never tear it down


def run_rank(rank: int, port: int, release) -> tuple:
    torch.set_num_threads(1)
    client = partial(dist.TCPStore, "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    store = client()
    a_to_b, b_to_c, c_to_a, faulty = transitions()
    pairs = {tuple(sorted((m.src, m.dst))) for manifest in (a_to_b, b_to_c, c_to_a, faulty)
             for r in manifest.rounds for m in r}
    world = tuple(range(WORLD))  # a barrier's group
    gen = Generation(connect_store=client, generation=0, me=rank, backend="gloo", timeout_s=30,
                     groups=[world, *pairs], flagged=lambda: store.check([FAULT]))
    truth = originals()
    initial = {k: {n: truth[k][n][box(r)].clone() for n, r in c_to_a.after[rank].items()} for k in KINDS}
    bad: list[str] = []
    if rank == 1:  # device 1 dies during A → B: it takes no part and loses its state
        state = {k: {} for k in KINDS}
    else:
        state = {k: {n: t.clone() for n, t in initial[k].items()} for k in KINDS}
        state = execute_manifest(a_to_b, me=rank, state=state, links=gen)
        bad += mismatches(state, a_to_b, rank, truth)
    for manifest in (b_to_c, c_to_a):
        state = execute_manifest(manifest, me=rank, state=state, links=gen)
        bad += mismatches(state, manifest, rank, truth)
    for kind in KINDS:
        same = set(state[kind]) == set(initial[kind])
        if not same or not all(torch.equal(state[kind][n], initial[kind][n]) for n in initial[kind]):
            bad.append(f"device {rank}: {kind} is not restored to layout A")
    gen.all_reduce(torch.zeros(1), world)  # a barrier

    victim = next(m.src for r in faulty.rounds for m in r if m.dst == 0)
    outcome = "hung"
    if rank == victim:  # alive but silent, as a hung worker; then flags the fault as the controller would
        time.sleep(FAULT_DEADLINE_S)
        store.set(FAULT, "1")
        release.wait(timeout=30)
    else:
        t0 = time.monotonic()
        try:
            execute_manifest(faulty, me=rank, state=state, links=gen)
            outcome = "done"
        except PeerFailure:
            outcome = f"raised after {time.monotonic() - t0:.2f}s"
    receivers = sorted({m.dst for r in faulty.rounds for m in r if m.src == victim})
    return rank, bad, outcome, victim, receivers


def test_a_to_b_to_c_to_a_is_bit_exact_and_faults_abandon_fast():
    a_to_b, b_to_c, c_to_a, _ = transitions()
    assert a_to_b.rounds and b_to_c.rounds and c_to_a.rounds, "every transition moves bytes over the wire"
    wq = "layers.0.attention.wq"
    wq_sources = [{m.src for m in c_to_a.moves if (m.dst, m.name) == (d, wq)} for d in range(WORLD)]
    assert any(len(srcs) > 1 for srcs in wq_sources), "C → A assembles a full tensor from TP shards"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    port = store.port  # hosted here, as the controller hosts it: it outlives every rank
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=worker, args=(r, port, results, release), daemon=True) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + 60
        while len(got) < WORLD:
            try:
                rank, *rest = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"workers {sorted(set(range(WORLD)) - set(got))} did not report in time") from None
            got[rank] = rest
            if len(got) == WORLD - 1:
                release.set()
        for p in procs:
            p.join(timeout=10)
        assert [p.exitcode for p in procs] == [0] * WORLD
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for rank, (bad, _, _, _) in got.items():
        assert not bad, bad
    _, _, victim, receivers = got[0]
    assert got[victim][1] == "hung" and 0 in receivers
    for r in receivers:
        outcome = got[r][1]
        assert outcome.startswith("raised"), (r, outcome)
        seconds = float(outcome.split()[2].rstrip("s"))
        assert seconds < FAULT_DEADLINE_S + 2, "the fault is noticed from the flag, not at the group timeout"
