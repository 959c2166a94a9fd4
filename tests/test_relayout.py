"""Re-layout manifests, checked by running them on tensors in one process against the originals."""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate

from chameleon.layout.plan import Pipeline, Plan, Stage, even_plan, plan_from_spec
from chameleon.decision.config import ClusterConfig
from chameleon.decision.planner import place
from chameleon.decision.profiler import analytic_profile
from chameleon.layout.geometry import MIGRATE_BYTES, LostStateError
from chameleon.layout.relayout import Manifest, relabel_plan, relayout
from chameleon.layout.spec import Layout, device_holdings, layout_of, local_slices, region_shape
from chameleon.model.config import ModelConfig
from chameleon.model.llama import TP_RULES, param_shapes, stage_param_names

CFG = ModelConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=20, multiple_of=8)
SHAPES = param_shapes(CFG)
NAMES = partial(stage_param_names, CFG)
_SEED = torch.Generator().manual_seed(0)
ORIGINALS = {name: torch.randn(shape, generator=_SEED) for name, shape in SHAPES.items()}


def layout(plan: Plan) -> Layout:
    return layout_of(plan, SHAPES, NAMES, rules=TP_RULES)


def box(region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def run_in_process(manifest: Manifest) -> dict[int, dict[str, torch.Tensor]]:
    """Reference executor: every device's new tensors, built only from what survivors held."""
    old = {d: {n: ORIGINALS[n][box(r)].clone() for n, r in held.items()} for d, held in manifest.before.items()}
    new, hits = {}, {}
    for d, held in manifest.after.items():
        new[d] = {n: torch.full(region_shape(r), float("nan")) for n, r in held.items()}
        hits[d] = {n: torch.zeros(region_shape(r), dtype=torch.int) for n, r in held.items()}
    for m in manifest.moves:
        piece = old[m.src][m.name][local_slices(m.region, manifest.before[m.src][m.name])]
        new[m.dst][m.name][local_slices(m.region, manifest.after[m.dst][m.name])] = piece
        hits[m.dst][m.name][local_slices(m.region, manifest.after[m.dst][m.name])] += 1
    for d, held in hits.items():
        for n, count in held.items():
            assert (count == 1).all(), f"device {d} {n}: moves do not tile its region exactly once"
    return new


def mask(name, region) -> np.ndarray:
    out = np.zeros(SHAPES[name], dtype=bool)
    out[box(region)] = True
    return out


def reference_cost(held: dict, needed: dict) -> int:
    """Bytes of ``needed`` not in ``held``, by counting elements of boolean masks."""
    missing = 0
    for name, region in needed.items():
        lack = mask(name, region) & ~(mask(name, held[name]) if name in held else False)
        missing += int(lack.sum())
    return missing * MIGRATE_BYTES


def check_manifest(manifest: Manifest, survivors, old: Layout, new_layout: Layout) -> None:
    """Validity of a manifest: exact result, survivors only, conflict-free rounds, byte totals, and every device
    of the new layout either rebuilt or keeping exactly what it held."""
    held, needs = device_holdings(old), device_holdings(new_layout)
    assert set(manifest.after) | manifest.kept == set(needs) and not set(manifest.after) & manifest.kept
    assert all(held[d] == needs[d] for d in manifest.kept)
    new = run_in_process(manifest)
    for d, held in manifest.after.items():
        for n, region in held.items():
            assert torch.equal(new[d][n], ORIGINALS[n][box(region)]), (d, n)
    assert set(manifest.before) <= set(survivors)
    assert all(m.local for m in manifest.local)
    links = [(m.src, m.dst) for r in manifest.rounds for m in r]
    assert all(src != dst for src, dst in links)
    seen_links = set()
    for moves in manifest.rounds:
        round_links = {(m.src, m.dst) for m in moves}
        assert not round_links & seen_links, "a link spans two rounds"
        seen_links |= round_links
        senders = [s for s, _ in round_links]
        receivers = [d for _, d in round_links]
        assert len(senders) == len(set(senders)) and len(receivers) == len(set(receivers))
    assert manifest.wire_bytes == sum(m.nbytes for m in manifest.moves if not m.local)
    assert all(0 < link <= total for link, total in zip(manifest.round_link_bytes, manifest.round_bytes))
    expected = sum(reference_cost(manifest.before.get(d, {}), held) for d, held in manifest.after.items())
    assert manifest.wire_bytes == expected, "the manifest moves exactly what receivers lack"


SCENARIOS = {
    "dp2pp2-dev1-dies-to-3-stages": (
        even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1),
        (0, 2, 3),
        plan_from_spec([{"layers": [1, 2, 1], "micro_batches": 4}], tp=1, n_layers=4, global_batch=4, micro_batch=1),
    ),
    "tp2-plus-new-device-to-pp3": (
        even_plan(dp=1, pp=1, tp=2, n_layers=4, global_batch=4, micro_batch=1),
        (0, 1, 2),
        plan_from_spec([{"layers": [1, 2, 1], "micro_batches": 4}], tp=1, n_layers=4, global_batch=4, micro_batch=1),
    ),
    "dp2pp2-to-pp2tp2": (
        even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1),
        (0, 1, 2, 3),
        even_plan(dp=1, pp=2, tp=2, n_layers=4, global_batch=4, micro_batch=1),
    ),
    "dp2tp2-dev3-dies-to-tp3": (
        even_plan(dp=2, pp=1, tp=2, n_layers=4, global_batch=4, micro_batch=1),
        (0, 1, 2),
        even_plan(dp=1, pp=1, tp=3, n_layers=4, global_batch=4, micro_batch=1),
    ),
    "dp3pp2-dev0-replaced-by-dev6": (
        even_plan(dp=3, pp=2, tp=1, n_layers=4, global_batch=6, micro_batch=1),
        (1, 2, 3, 4, 5, 6),
        even_plan(dp=3, pp=2, tp=1, n_layers=4, global_batch=6, micro_batch=1),
    ),
}


def cfg_profile(tp: int):
    """An analytic profile of ``CFG`` (its parameter counts are what placement weighs)."""
    cluster = ClusterConfig(kind="analytic", memory_gb=1.0, peak_tflops=1.0, hbm_gbps=1.0, intra_gbps=1.0,
                            inter_gbps=1.0)
    return analytic_profile(CFG, cluster, micro_batch=1, seq_len=8, tp=tp)


def on_survivors(slot_plan: Plan, survivors) -> Plan:
    """The slot plan's devices 0, 1, ... put on the survivors in order."""
    return relabel_plan(slot_plan, dict(zip(range(len(slot_plan.devices)), survivors)))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_relayout_to_a_new_plan_is_exact(scenario):
    old_plan, survivors, slot_plan = SCENARIOS[scenario]
    target = layout(on_survivors(slot_plan, survivors))
    manifest = relayout(layout(old_plan), target, survivors=survivors)
    check_manifest(manifest, survivors, layout(old_plan), target)


PLACEMENTS = {  # scenarios whose new plan keeps the old TP groups, as the planner's plans do
    name: SCENARIOS[name] for name in ("dp2pp2-dev1-dies-to-3-stages", "dp3pp2-dev0-replaced-by-dev6")
} | {
    "pp3tp2-resplit": (
        plan_from_spec([{"layers": [2, 1, 1], "micro_batches": 6}], tp=2, n_layers=4, global_batch=6, micro_batch=1),
        (4, 5, 2, 3, 0, 1),
        plan_from_spec([{"layers": [1, 1, 2], "micro_batches": 6}], tp=2, n_layers=4, global_batch=6, micro_batch=1),
    ),
    # devices 3 and 6 die: stage 1's shard 0 lives on device 2 (pipeline 0), shard 1 on device 7 (pipeline 1); regrouped
    # as (2, 7) (the geometry's units) they rebuild stage 1 without moving a byte
    "dp2pp2tp2-stage-rebuilt-from-two-replicas": (
        even_plan(dp=2, pp=2, tp=2, n_layers=4, global_batch=4, micro_batch=1),
        (0, 1, 4, 5, 2, 7),
        plan_from_spec([{"layers": [4], "micro_batches": 2}, {"layers": [2, 2], "micro_batches": 2}], tp=2, n_layers=4,
                       global_batch=4, micro_batch=1),
    ),
}


@pytest.mark.parametrize("scenario", PLACEMENTS)
def test_placement_moves_the_fewest_bytes(scenario):
    """The planner's placement against every assignment of the survivors' TP groups to the new stages."""
    old_plan, survivors, slot_plan = PLACEMENTS[scenario]
    tp = slot_plan.pipelines[0].stages[0].tp
    profile = cfg_profile(tp)
    groups = [tuple(survivors[i:i + tp]) for i in range(0, len(survivors), tp)]
    before = device_holdings(layout(old_plan))

    def wire_bytes(plan: Plan) -> int:
        return sum(reference_cost(before.get(d, {}), held) for d, held in device_holdings(layout(plan)).items())

    def on_groups(order) -> Plan:
        """The slot plan's k-th stage on the k-th group of ``order`` (slot devices are in stage order)."""
        devices = [d for g in order for d in g]
        return relabel_plan(slot_plan, dict(zip(slot_plan.devices, devices)))

    best = min(wire_bytes(on_groups(order)) for order in itertools.permutations(groups))
    placed = place(on_groups(groups), old_plan, profile)
    assert wire_bytes(placed) == best
    check_manifest(relayout(layout(old_plan), layout(placed), survivors=survivors), survivors, layout(old_plan),
                   layout(placed))


def test_paper_figure_3():
    """Fig. 3: cards {1,2,3},{4,5,6},{7,8,9} + an empty one → stages {1,2},{3,4},{5,6},{7,8,9}.

    Each "layer" is a one-element tensor and a byte per element, so costs count layers.
    """
    shapes = {f"layer{i}": (1,) for i in range(9)}
    rules = ((r"layer\d", (Replicate(),)),)

    def names(layers, *, first, last):
        return [f"layer{i}" for i in range(*layers)]

    old_plan = Plan(
        n_layers=9,
        micro_batch_size=1,
        pipelines=(Pipeline((Stage((0,), (0, 3)), Stage((1,), (3, 6)), Stage((2,), (6, 9))), micro_batches=1),),
    )
    slot_plan = plan_from_spec(
        [{"layers": [2, 2, 2, 3], "micro_batches": 1}], tp=1, n_layers=9, global_batch=1, micro_batch=1
    )
    one_element_layers = replace(cfg_profile(1), n_layers=9, layer_params=1, first_params=0, last_params=0)
    plan = place(slot_plan, old_plan, one_element_layers)  # device 3 is the incoming empty card
    assert [s.devices for s in plan.pipelines[0].stages] == [(0,), (3,), (1,), (2,)]
    # The naive in-order mapping (card i → slot i) moves 0+1+2+3 = 6 layers (the digest's "7" misadds).
    old_layout = layout_of(old_plan, shapes, names, rules=rules)
    naive = relayout(old_layout, layout_of(slot_plan, shapes, names, rules=rules), survivors=(0, 1, 2, 3))
    assert naive.wire_bytes == 6 * MIGRATE_BYTES
    manifest = relayout(old_layout, layout_of(plan, shapes, names, rules=rules), survivors=(0, 1, 2, 3))
    wire = sorted((m.name, m.src, m.dst) for m in manifest.moves if not m.local)
    assert wire == [("layer2", 0, 3), ("layer3", 1, 3)]
    assert manifest.wire_bytes == 2 * MIGRATE_BYTES and len(manifest.rounds) == 2  # device 3 receives one link per round


def test_sources_are_balanced_over_replicas():
    old_plan, survivors, slot_plan = SCENARIOS["dp3pp2-dev0-replaced-by-dev6"]
    manifest = relayout(layout(old_plan), layout(relabel_plan(slot_plan, {0: 6} | {d: d for d in survivors[:-1]})),
                        survivors=survivors)
    sent = {}
    for m in manifest.moves:
        if not m.local:
            assert m.dst == 6
            sent[m.src] = sent.get(m.src, 0) + m.nbytes
    largest = max(np.prod(s) for s in SHAPES.values()) * MIGRATE_BYTES
    assert set(sent) == {2, 4} and abs(sent[2] - sent[4]) <= largest
    assert len(manifest.rounds) == 2  # device 6 receives from one link per round


def test_lost_state_and_bad_inputs():
    old = layout(even_plan(dp=1, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1))
    one_stage = plan_from_spec([{"layers": [4], "micro_batches": 4}], tp=1, n_layers=4, global_batch=4, micro_batch=1)
    with pytest.raises(LostStateError, match="checkpoint"):
        relayout(old, layout(one_stage), survivors=(0,))
    two_stages = even_plan(dp=1, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1)
    with pytest.raises(ValueError, match="not survivors"):
        relayout(old, layout(two_stages), survivors=(0,))


def test_relabel_plan():
    plan = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1)
    relabelled = relabel_plan(plan, {0: 7, 1: 5, 2: 6, 3: 4})
    assert relabelled.devices == (7, 5, 6, 4)
    assert [p.stages[0].layers for p in relabelled.pipelines] == [p.stages[0].layers for p in plan.pipelines]
    assert relabel_plan(relabelled, {7: 0, 5: 1, 6: 2, 4: 3}) == plan


def test_devices_whose_regions_do_not_change_keep_their_state_and_only_send():
    """A spare takes a lost device's place: every other device keeps its state untouched (no copy, no entry in
    ``after``), and the replica that holds the lost stage only sends."""
    old_plan = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1)  # 0,1 | 2,3
    new_plan = relabel_plan(old_plan, {0: 0, 1: 4, 2: 2, 3: 3})
    survivors = (0, 2, 3, 4)
    manifest = relayout(layout(old_plan), layout(new_plan), survivors=survivors)
    check_manifest(manifest, survivors, layout(old_plan), layout(new_plan))
    assert manifest.kept == {0, 2, 3} and set(manifest.after) == {4}
    assert {m.src for m in manifest.moves} == {3} and set(manifest.before) == {3}
