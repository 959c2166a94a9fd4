"""Layouts, holdings and manifests worked out once per stage shape (shared by identical pipelines), against
straightforward references that work out every tensor of every device on its own."""

from __future__ import annotations

import itertools

import pytest

from chameleon.decision.config import ClusterConfig, PolicyConfig
from chameleon.decision.coordinator import Coordinator
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import analytic_profile
from chameleon.layout import memory
from chameleon.layout.geometry import MIGRATE_BYTES, Part, geometry_of, replica_groups, writers
from chameleon.layout.plan import Plan, even_plan, plan_from_spec
from chameleon.layout.relayout import Move, relabel_plan, relayout, relayout_held
from chameleon.layout.spec import (
    Holder,
    TensorSpec,
    contains,
    device_holdings,
    layout_of,
    placements_for,
    region_numel,
    shard_region,
    stage_holdings,
)
from chameleon.model.llama import TP_RULES
from chameleon.model.spec import spec_of
from tests.test_layout import CFG, NAMES, SHAPES  # a model of 8 small layers


def reference_layout(plan: Plan) -> dict:
    """Every stage's every tensor, one holder each, in pipeline-then-stage order."""
    holders: dict[str, list[Holder]] = {}
    for p in plan.pipelines:
        for s, stage in enumerate(p.stages):
            for name in NAMES(stage.layers, first=s == 0, last=s == p.n_stages - 1):
                held = holders.setdefault(name, [])
                if stage.devices:
                    held.append(Holder(stage.devices, placements_for(name, rules=TP_RULES)))
    return {name: TensorSpec(name, SHAPES[name], tuple(h)) for name, h in holders.items()}


def reference_manifest(old: dict, new: dict, survivors) -> tuple:
    """Every needed region of every device on its own: kept where unchanged, local where held, whole from the
    least-loaded exact replica where the receiver holds none of it, else cut along every held boundary, each
    piece from the least-loaded holder (bytes sent, then id); links coloured heaviest first into rounds."""
    held = {d: old[d] for d in sorted(set(survivors)) if d in old}
    kept = {d for d, regions in new.items() if held.get(d) == regions}
    after = {d: regions for d, regions in new.items() if d not in kept}
    sent = dict.fromkeys(held, 0)

    def least_loaded(name, fits) -> int:
        src = min((sent[d], d) for d, regions in held.items() if name in regions and fits(regions[name]))[1]
        return src

    local, wire = [], []
    for dst in sorted(after):
        for name, need in after[dst].items():
            own = held.get(dst, {}).get(name)
            if not region_numel(need):
                continue
            if own is not None and contains(own, need):
                local.append(Move(name, need, dst, dst, region_numel(need) * MIGRATE_BYTES))
                continue
            if own is None and any(regions.get(name) == need for regions in held.values()):
                src = least_loaded(name, lambda r: r == need)
                sent[src] += region_numel(need)
                wire.append(Move(name, need, src, dst, region_numel(need) * MIGRATE_BYTES))
                continue
            cuts = [sorted({lo, hi} | {x for regions in held.values() if name in regions
                                       for x in regions[name][k] if lo < x < hi}) for k, (lo, hi) in enumerate(need)]
            pieces = []
            for cell in itertools.product(*(list(itertools.pairwise(c)) for c in cuts)):
                src = None if own is not None and contains(own, cell) else least_loaded(name, lambda r: contains(r, cell))
                if src is not None:
                    sent[src] += region_numel(cell)
                pieces.append((src, cell))
            merged = []
            for src, cell in pieces:
                if merged and merged[-1][0] == src:
                    diff = [k for k, (a, b) in enumerate(zip(merged[-1][1], cell)) if a != b]
                    if len(diff) == 1 and merged[-1][1][diff[0]][1] == cell[diff[0]][0]:
                        k, prev = diff[0], merged[-1][1]
                        merged[-1] = (src, prev[:k] + ((prev[k][0], cell[k][1]),) + prev[k + 1:])
                        continue
                merged.append((src, cell))
            for src, cell in merged:
                (local if src is None else wire).append(
                    Move(name, cell, dst if src is None else src, dst, region_numel(cell) * MIGRATE_BYTES))
    links: dict[tuple[int, int], list[Move]] = {}
    for m in wire:
        links.setdefault((m.src, m.dst), []).append(m)
    rounds: list[list[Move]] = []
    for src, dst in sorted(links, key=lambda k: (-sum(m.nbytes for m in links[k]), k)):
        r = next(r for r in itertools.count() if r == len(rounds) or
                 all(m.src != src and m.dst != dst for m in rounds[r]))
        if r == len(rounds):
            rounds.append([])
        rounds[r].extend(links[src, dst])
    senders = {m.src for m in wire} | set(after)
    return (tuple(local), tuple(map(tuple, rounds)), [(d, list(r.items())) for d, r in held.items() if d in senders],
            [(d, list(r.items())) for d, r in after.items()], sorted(kept))


def flat(manifest) -> tuple:
    """A manifest with the order of its dicts."""
    return (manifest.local, manifest.rounds, [(d, list(r.items())) for d, r in manifest.before.items()],
            [(d, list(r.items())) for d, r in manifest.after.items()], sorted(manifest.kept))


def holdings(plan: Plan) -> dict:
    return stage_holdings(plan, SHAPES, NAMES, rules=TP_RULES)


def uneven(spec: list[dict], tp: int, survivors) -> Plan:
    slots = plan_from_spec(spec, tp=tp, n_layers=8, global_batch=12, micro_batch=1)
    return relabel_plan(slots, dict(zip(range(len(slots.devices)), survivors)))


EVEN = even_plan(dp=6, pp=2, tp=2, n_layers=8, global_batch=12, micro_batch=1)  # six identical pipelines, 24 devices
CASES = {
    "a pipeline lost, re-planned at TP 1 on more stages": (
        EVEN, range(20),
        uneven([{"layers": [2, 2, 2, 2], "micro_batches": 3}] * 4, tp=1, survivors=range(16))),
    "a device lost, identical and uneven pipelines mixed, TP kept": (
        EVEN, [d for d in range(24) if d != 5],
        uneven([{"layers": [4, 4], "micro_batches": 3}] * 3 + [{"layers": [2, 3, 3], "micro_batches": 3}],
               tp=2, survivors=[d for d in range(24) if d != 5])),
    "a pipeline lost, two idle devices join, uneven shares": (
        EVEN, range(4, 26),
        uneven([{"layers": [4, 4], "micro_batches": m} for m in (3, 3, 2, 2, 2)], tp=2,
               survivors=[24, 25, *range(4, 22)])),
    "TP 2 to TP 3, every tensor cut anew": (
        EVEN, range(24),
        uneven([{"layers": [4, 4], "micro_batches": 3}] * 4, tp=3, survivors=range(24))),
}


@pytest.mark.parametrize("case", CASES)
def test_shared_layouts_holdings_and_manifests_match_the_references(case):
    old, survivors, new = CASES[case]
    assert len({id(regions) for regions in holdings(old).values()}) == 4  # two stage shapes, two TP indices
    for plan in (old, new):
        assert list(layout_of(plan, SHAPES, NAMES, rules=TP_RULES).items()) == list(reference_layout(plan).items())
        reference = device_holdings(reference_layout(plan))
        assert [(d, list(r.items())) for d, r in holdings(plan).items()] == \
               [(d, list(r.items())) for d, r in reference.items()]
        assert replica_groups(holdings(plan)) == replica_groups(reference)
        for d, regions in reference.items():
            assert all(r == shard_region(SHAPES[n], placements_for(n, rules=TP_RULES), *_seat(plan, d))
                       for n, r in regions.items())
    expected = reference_manifest(device_holdings(reference_layout(old)), device_holdings(reference_layout(new)),
                                  survivors)
    assert flat(relayout_held(holdings(old), holdings(new), survivors=survivors, bytes_per_element=MIGRATE_BYTES)) == expected
    assert flat(relayout(reference_layout(old), reference_layout(new), survivors=survivors,
                         bytes_per_element=MIGRATE_BYTES)) == expected


def _seat(plan: Plan, device: int) -> tuple[int, int]:
    """``device``'s TP index and its stage's TP size."""
    stage = next(st for p in plan.pipelines for st in p.stages if device in st.devices)
    return stage.devices.index(device), stage.tp


@pytest.mark.parametrize("domains", [None, [(0, 1), (2, 3, 4, 5), tuple(range(6, 14))], [tuple(range(24))]])
@pytest.mark.parametrize("plan", [EVEN, CASES["a device lost, identical and uneven pipelines mixed, TP kept"][2]])
def test_exposure_matches_a_count_of_every_part(plan, domains):
    assert geometry_of(plan).exposure(domains) == reference_exposure(plan, domains)


def reference_exposure(plan: Plan, domains) -> float:
    """The share of ``domains`` (None: every device alone) that hold every holder of some part."""
    geometry = geometry_of(plan)
    parts = [Part(b, t) for b, bucket in enumerate(geometry.buckets) for t in range(bucket.tp)]
    groups = [(d,) for d in geometry.seat] if domains is None else [g for g in domains if g]
    return sum(any(set(geometry.holders(part)) <= set(g) for part in parts) for g in groups) / len(groups)


def test_the_coordinator_decides_and_moves_as_the_references_do():
    """A node of a six-pipeline job lost: the coordinator's manifest, from its shared holdings, is the reference's
    on the layouts of the resident and the chosen plan, its replica groups and writers are the reference's, and
    every candidate's peak memory and exposure are counted afresh."""
    model = CFG
    cluster = ClusterConfig(kind="analytic", memory_gb=1.0, peak_tflops=1.0, hbm_gbps=1.0, intra_gbps=1.0,
                            inter_gbps=1.0)
    profile = analytic_profile(model, cluster, micro_batch=1, seq_len=8, tp=2)
    domains = tuple(tuple(range(4 * n, 4 * n + 4)) for n in range(6))
    coordinator = Coordinator(model=model, profile=profile, planner=Planner(profile), policy=PolicyConfig(),
                              domains=domains)
    alive = set(range(20))
    move = coordinator.recover(EVEN, alive=alive, next_step=1, saved=None, now=0.0, fault_times=[], elapsed_s=60.0,
                               precomputed=None)
    layouts = [spec_of(model).layout(model, plan) for plan in (EVEN, move.plan)]
    assert [list(lay.items()) for lay in layouts] == [list(reference_layout(p).items()) for p in (EVEN, move.plan)]
    assert flat(move.manifest) == reference_manifest(*map(device_holdings, layouts), sorted(alive))
    assert coordinator.replica_groups(move.plan) == replica_groups(device_holdings(layouts[1]))
    assert coordinator.writers(move.plan) == tuple(sorted(writers(reference_layout(move.plan))))
    left = tuple(tuple(d for d in domain if d in alive) for domain in domains)
    for c in move.decision.candidates:
        if c.plan is not None:
            assert c.peak_memory == max(memory.plan_memory(profile.memory_costs, c.plan).values())
            assert c.exposure == reference_exposure(c.plan, [g for g in left if g])
