"""Layouts (plan → sharding specs) and gradient-sync colouring, against direct references."""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict
from functools import partial

import numpy as np
import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from chameleon.layout.colouring import dsatur
from chameleon.layout.geometry import geometry_of, sync_rounds
from chameleon.layout.plan import Pipeline, Plan, Recompute, Reroute, Stage, even_plan, plan_from_spec
from chameleon.layout.spec import (
    device_holdings,
    intersect,
    layout_of,
    local_slices,
    placements_for,
    shard_region,
)
from chameleon.model.config import ModelConfig
from chameleon.model.llama import TP_RULES, param_shapes, stage_param_names

CFG = ModelConfig(dim=16, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=20, multiple_of=8)
SHAPES = param_shapes(CFG)
NAMES = partial(stage_param_names, CFG)


def layout(plan: Plan):
    return layout_of(plan, SHAPES, NAMES, rules=TP_RULES)


def true_holders(plan: Plan, name: str, t: int) -> set[int]:
    """Reference: the devices holding TP shard ``t`` of ``name``, read straight off the plan."""
    layer = re.match(r"layers\.(\d+)\.", name)
    out = set()
    for p in plan.pipelines:
        for s, stage in enumerate(p.stages):
            if layer:
                mine = stage.layers[0] <= int(layer[1]) < stage.layers[1]
            else:
                mine = s == (0 if name == "tok_embeddings" else p.n_stages - 1)
            if mine and stage.devices:
                out.add(stage.devices[t])
    return out


def test_rules_give_megatron_placements():
    assert placements_for("layers.3.attention.wq", rules=TP_RULES) == (Shard(0),)
    assert placements_for("layers.3.attention.wk", rules=TP_RULES) == (Shard(0),)
    assert placements_for("layers.3.feed_forward.w3", rules=TP_RULES) == (Shard(0),)
    assert placements_for("layers.3.attention.wo", rules=TP_RULES) == (Shard(1),)
    assert placements_for("layers.3.feed_forward.w2", rules=TP_RULES) == (Shard(1),)
    for name in ("layers.3.attention_norm", "layers.3.ffn_norm", "norm", "tok_embeddings", "output"):
        assert placements_for(name, rules=TP_RULES) == (Replicate(),)
    with pytest.raises(ValueError, match="no sharding rule"):
        placements_for("layers.3.attention.bias", rules=TP_RULES)
    assert set(SHAPES) == {n for n in SHAPES if placements_for(n, rules=TP_RULES)}


@pytest.mark.parametrize("n", [1, 5, 7, 8, 12])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_region_matches_torch_chunk(n, tp, dim):
    shape = (n, 3) if dim == 0 else (3, n)
    full = torch.arange(3 * n).reshape(shape)
    chunks = torch.chunk(full, tp, dim=dim)
    for t in range(tp):
        region = shard_region(shape, (Shard(dim),), t, tp)
        piece = full[tuple(slice(a, b) for a, b in region)]
        expected = chunks[t] if t < len(chunks) else full.narrow(dim, 0, 0)
        assert piece.shape == expected.shape and torch.equal(piece, expected)
        assert shard_region(shape, (Replicate(),), t, tp) == ((0, shape[0]), (0, shape[1]))


def test_even_layout_holders_and_tiling():
    plan = even_plan(dp=2, pp=2, tp=2, n_layers=8, global_batch=4, micro_batch=1)
    specs = layout(plan)
    assert list(specs) == list(SHAPES)
    for name, spec in specs.items():
        assert spec.shape == SHAPES[name]
        assert len(spec.holders) == 2
        for t in range(2):
            assert {h.devices[t] for h in spec.holders} == true_holders(plan, name, t)
    holdings = device_holdings(specs)
    assert sorted(holdings) == list(range(8))
    for p in plan.pipelines:
        for s, stage in enumerate(p.stages):
            for name in NAMES(stage.layers, first=s == 0, last=s == p.n_stages - 1):
                count = np.zeros(SHAPES[name], dtype=int)
                for d in stage.devices:
                    count[tuple(slice(a, b) for a, b in holdings[d][name])] += 1
                expected = 2 if placements_for(name, rules=TP_RULES) == (Replicate(),) else 1
                assert (count == expected).all(), name
    assert "tok_embeddings" in holdings[0] and "tok_embeddings" not in holdings[2]
    assert "output" in holdings[6] and "output" not in holdings[4]


def test_dead_stage_holds_nothing():
    plan = Plan(
        n_layers=8,
        micro_batch_size=1,
        pipelines=(
            Pipeline((Stage((0,), (0, 4)), Stage((1,), (4, 8))), micro_batches=2),
            Pipeline((Stage((), (0, 4)), Stage((3,), (4, 8))), micro_batches=2),
        ),
        reroutes=(Reroute(pipeline=1, stage=0, hosts=(0,)),),
    )
    specs = layout(plan)
    assert [h.devices for h in specs["layers.2.attention.wq"].holders] == [(0,)]
    assert [h.devices for h in specs["layers.6.attention.wq"].holders] == [(1,), (3,)]
    assert set(device_holdings(specs)) == {0, 1, 3}


def test_region_helpers():
    assert intersect(((0, 4), (0, 3)), ((2, 6), (1, 3))) == ((2, 4), (1, 3))
    assert intersect(((0, 4),), ((4, 6),)) is None
    assert local_slices(((2, 4), (1, 3)), ((2, 6), (0, 3))) == (slice(0, 2), slice(1, 3))
    with pytest.raises(ValueError):
        local_slices(((0, 4),), ((2, 6),))


def check_rounds(plan: Plan, tp: int) -> tuple:
    """Assert the sync rounds of a plan are valid against the reference holders; return them."""
    specs = layout(plan)
    rounds = sync_rounds(geometry_of(plan), specs)
    groups = [g for r in rounds for g in r]
    for r in rounds:
        devices = [d for g in r for d in g.devices]
        assert len(devices) == len(set(devices)), "a device appears twice in a round"
    assert len({g.devices for g in groups}) == len(groups), "holder sets are bucketed"
    for name in SHAPES:
        for t in range(tp):
            holders = true_holders(plan, name, t)
            containing = [g for g in groups if name in g.names and set(g.devices) & holders]
            if len(holders) > 1:
                assert [set(g.devices) for g in containing] == [holders], (name, t)
            else:
                assert not containing
    return rounds


def test_even_sync_is_one_round_per_stage_group():
    plan = even_plan(dp=2, pp=2, tp=1, n_layers=8, global_batch=4, micro_batch=1)
    rounds = check_rounds(plan, tp=1)
    assert len(rounds) == 1
    assert sorted(g.devices for g in rounds[0]) == [(0, 2), (1, 3)]
    plan = even_plan(dp=2, pp=2, tp=2, n_layers=8, global_batch=4, micro_batch=1)
    rounds = check_rounds(plan, tp=2)
    assert len(rounds) == 1
    assert sorted(g.devices for g in rounds[0]) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    by_devices = {g.devices: g.names for g in rounds[0]}
    assert by_devices[(0, 4)] == by_devices[(1, 5)] == tuple(NAMES((0, 4), first=True, last=False))


@pytest.mark.parametrize(
    ("spec", "n_devices"),
    [
        ([{"layers": [3, 3, 2], "micro_batches": 2}, {"layers": [2, 2, 2, 2], "micro_batches": 2}], 7),
        ([{"layers": [4, 4], "micro_batches": 2}, {"layers": [3, 3, 2], "micro_batches": 2}], 5),
    ],
)
def test_uneven_sync_rounds_match_holders(spec, n_devices):
    plan = plan_from_spec(spec, tp=1, n_layers=8, global_batch=4, micro_batch=1)
    assert len(plan.devices) == n_devices
    rounds = check_rounds(plan, tp=1)
    assert len(rounds) == 2  # overlapping groups exist, and DSATUR is exact here (a bipartite conflict graph)


def test_uneven_sync_with_tp_pairs_tp_indices():
    spec = [{"layers": [4, 4], "micro_batches": 2}, {"layers": [3, 3, 2], "micro_batches": 2}]
    plan = plan_from_spec(spec, tp=2, n_layers=8, global_batch=4, micro_batch=1)
    check_rounds(plan, tp=2)


def test_dsatur_is_proper_and_exact_on_bipartite_graphs():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randrange(1, 25)
        edges = {(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.3}
        adjacency = [{b for a, b in edges if a == v} | {a for a, b in edges if b == v} for v in range(n)]
        colours = dsatur(adjacency)
        assert all(colours[a] != colours[b] for a, b in edges)
        side = [rng.random() < 0.5 for _ in range(n)]
        bipartite = [{u for u in adjacency[v] if side[u] != side[v]} for v in range(n)]
        assert max(dsatur(bipartite)) + 1 <= 2


def test_a_large_plan_is_summarised_by_shape_and_a_small_one_described_whole():
    small = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=8, micro_batch=2)
    assert small.summary() == small.describe()
    big = even_plan(dp=512, pp=2, tp=2, n_layers=4, global_batch=2048, micro_batch=2)
    after = even_plan(dp=511, pp=2, tp=2, n_layers=4, global_batch=2044, micro_batch=2)
    text = after.summary(big)
    assert text.splitlines() == [
        "511 × [0:2|2:4] tp2 ×2mb",
        "511 pipelines on 2044 devices, 1022 micro-batches, 0 reroutes",
        "changed: 4 devices out, 0 in, 512 → 511 pipelines",
    ]


def test_a_plans_dict_is_what_asdict_makes_of_it():
    plan = Plan(4, 2, (Pipeline((Stage((0, 1), (0, 2), Recompute.full), Stage((2,), (2, 4))), 3),
                       Pipeline((Stage((), (0, 2)), Stage((3,), (2, 4), Recompute.selective)), 2)),
                (Reroute(1, 0, (0,)),))
    assert plan.to_dict() == asdict(plan)
    assert json.dumps(plan.to_dict()) == json.dumps(asdict(plan))
