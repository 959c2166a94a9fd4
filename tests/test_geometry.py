"""The geometry of a plan against brute force over its layout's shards: holders, lost regions, exposure, what a
device lacks; the survivors' units; the lines naming what is lost; the byte table against the runtime's state."""

from __future__ import annotations

import itertools
import math
import random
from functools import partial

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from chameleon.config import TrainConfig
from chameleon.decision.selector import reroute_plan
from chameleon.layout.geometry import (
    EMBEDDING,
    Geometry,
    Part,
    UnitParams,
    geometry_of,
    state_bytes,
    sync_rounds,
    tp_units,
)
from chameleon.layout.plan import Pipeline, Plan, PlanError, Stage, even_plan, plan_from_spec
from chameleon.layout.relayout import relabel_plan, relayout
from chameleon.layout.spec import contains, device_holdings, placements_for, region_numel, shard_region
from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of

LLAMA_CFG_4 = ModelConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=20, multiple_of=8)
LLAMA_CFG = ModelConfig(dim=16, n_layers=6, n_heads=4, n_kv_heads=4, vocab_size=20, multiple_of=8)
GPT_CFG = ModelConfig(arch="gpt", dim=16, n_layers=6, n_heads=4, n_kv_heads=4, vocab_size=20, multiple_of=8)
CONFIGS = {"llama": LLAMA_CFG, "gpt": GPT_CFG}


def layout(cfg: ModelConfig, plan: Plan):
    return spec_of(cfg).layout(cfg, plan)


def unit_names(cfg: ModelConfig) -> dict[int, list[str]]:
    """Each model unit's tensor names, from the spec (−1 the embedding, ``L`` the head)."""
    names = partial(spec_of(cfg).stage_param_names, cfg)
    out = {i: names((i, i + 1), first=False, last=False) for i in range(cfg.n_layers)}
    return out | {EMBEDDING: names((0, 0), first=True, last=False), cfg.n_layers: names((0, 0), first=False, last=True)}


def brute_holders(lay) -> dict[tuple[str, tuple], set[int]]:
    """Every atom of every tensor — a cell of the grid that all its holders' region boundaries cut it into, inside
    some region — with the devices whose region contains it."""
    holdings = device_holdings(lay)
    out = {}
    for name, spec in lay.items():
        regions = [held[name] for held in holdings.values() if name in held and region_numel(held[name])]
        cuts = [sorted({x for r in regions for x in r[dim]}) for dim in range(len(spec.shape))]
        for cell in itertools.product(*(list(zip(c, c[1:])) for c in cuts)):
            holders = {d for d, held in holdings.items() if name in held and contains(held[name], cell)}
            if holders:
                out[(name, cell)] = holders
    return out


def geometry_holders(cfg: ModelConfig, g: Geometry, lay) -> dict[tuple[str, tuple], set[Part]]:
    """The parts each (tensor, region) belongs to, as the geometry's buckets and shards give them."""
    names = unit_names(cfg)
    out: dict[tuple[str, tuple], set[Part]] = {}
    for b, bucket in enumerate(g.buckets):
        for name in (n for u in bucket.units for n in names[u]):
            for t in range(bucket.tp):
                region = shard_region(lay[name].shape, lay[name].holders[0].placements, t, bucket.tp)
                if region_numel(region):
                    out.setdefault((name, region), set()).add(Part(b, t))
    return out


def random_plan(rng: random.Random, n_layers: int) -> Plan:
    """An even plan (sometimes rerouted), an uneven one, one pipeline whose stages differ in TP size, or replicas
    each of its own TP size (uneven too)."""
    kind, tp = rng.choice(["even", "uneven", "mixed", "replicas"]), rng.choice([1, 2, 4])
    if kind == "replicas":
        specs = []
        for _ in range(rng.randint(2, 3)):
            cuts = sorted(rng.sample(range(1, n_layers), rng.randint(0, 2)))
            specs.append({"layers": [b - a for a, b in zip([0] + cuts, cuts + [n_layers])], "micro_batches": 2,
                          "tp": rng.choice([1, 2, 4])})
        return plan_from_spec(specs, tp=1, n_layers=n_layers, global_batch=2 * len(specs), micro_batch=1)
    if kind == "mixed":
        cuts = sorted(rng.sample(range(1, n_layers), rng.randint(0, 3)))
        bounds = list(zip([0] + cuts, cuts + [n_layers]))
        stages, next_id = [], 0
        for b in bounds:
            width = rng.choice([1, 2, 4])
            stages.append(Stage(tuple(range(next_id, next_id + width)), b))
            next_id += width
        return Plan(n_layers=n_layers, micro_batch_size=1, pipelines=(Pipeline(tuple(stages), 2),))
    if kind == "uneven":
        specs = []
        for _ in range(rng.randint(2, 3)):
            cuts = sorted(rng.sample(range(1, n_layers), rng.randint(0, 3)))
            specs.append({"layers": [b - a for a, b in zip([0] + cuts, cuts + [n_layers])], "micro_batches": 2})
        return plan_from_spec(specs, tp=tp, n_layers=n_layers, global_batch=2 * len(specs), micro_batch=1)
    dp, pp = rng.randint(1, 3), rng.randint(1, 3)
    plan = even_plan(dp=dp, pp=pp, tp=tp, n_layers=n_layers, global_batch=2 * dp, micro_batch=1)
    if dp > 1 and rng.random() < 0.5:
        try:
            plan = reroute_plan(plan, {rng.choice(plan.devices)})
        except PlanError:
            pass
    return plan


@pytest.mark.parametrize("arch", CONFIGS)
def test_every_spec_keeps_the_embedding_and_head_whole(arch):
    """The geometry's convention, checked against each model spec's tp_rules: the embedding and head replicated,
    a layer's tensors sharded or replicated (its shards then line up with every other TP size's)."""
    cfg, spec = CONFIGS[arch], spec_of(CONFIGS[arch])
    names = unit_names(cfg)
    for unit in (EMBEDDING, cfg.n_layers):
        assert all(placements_for(n, rules=spec.tp_rules) == (Replicate(),) for n in names[unit])
    sharded = [n for n in names[0] if placements_for(n, rules=spec.tp_rules) != (Replicate(),)]
    assert sharded and all(isinstance(placements_for(n, rules=spec.tp_rules)[0], Shard) for n in sharded)


@pytest.mark.parametrize("seed", range(60))
def test_holders_lost_regions_and_exposure_equal_a_brute_force_over_the_layouts_shards(seed):
    rng = random.Random(seed)
    cfg = CONFIGS["llama" if seed % 2 else "gpt"]
    plan = random_plan(rng, cfg.n_layers)
    lay, g = layout(cfg, plan), geometry_of(plan)
    brute, parts = brute_holders(lay), geometry_holders(cfg, g, lay)
    assert brute.keys() == parts.keys()
    for key, of in parts.items():
        assert brute[key] == {d for part in of for d in g.holders(part)}, key
    holdings = device_holdings(lay)
    for d, held in holdings.items():  # each device's holding is its layout's regions
        h, names = g.holding(d), unit_names(cfg)
        assert set(held) == {n for u in range(h.lo, h.hi) for n in names[u]}
        assert all(r == shard_region(lay[n].shape, lay[n].holders[0].placements, h.shard, h.tp) for n, r in held.items())
    devices = list(plan.devices)
    for _ in range(8):
        failed = set(rng.sample(devices, rng.randint(0, len(devices))))
        lost = set(g.lost(failed))
        assert {k for k, holders in brute.items() if holders <= failed} == {k for k, of in parts.items() if of <= lost}
        assert (g.describe(g.lost(failed)) == "nothing") == (not lost)
    for size in (1, 2, 3):
        order = rng.sample(devices, len(devices))
        domains = [tuple(order[i:i + size]) for i in range(0, len(order), size)]
        expected = sum(any(h <= set(dom) for h in brute.values()) for dom in domains) / len(domains)
        assert g.exposure(domains) == pytest.approx(expected)
    assert g.exposure(None) == pytest.approx(sum(any(h <= {d} for h in brute.values()) for d in devices) / len(devices))


@pytest.mark.parametrize("seed", range(30))
def test_what_a_device_lacks_is_what_a_relayout_sends_it(seed):
    """Elements each device of a new plan (any TP size, on survivors and fresh devices) lacks, against the manifest
    built from the layouts; the layers' replicated norms left out, which the geometry counts as sharded."""
    rng = random.Random(seed)
    cfg = LLAMA_CFG
    old = random_plan(rng, cfg.n_layers)
    spec, names, shapes = spec_of(cfg), unit_names(cfg), spec_of(LLAMA_CFG).param_shapes(LLAMA_CFG)
    keep = {n for u, ns in names.items() for n in ns
            if u in (EMBEDDING, cfg.n_layers) or placements_for(n, rules=spec.tp_rules) != (Replicate(),)}
    tp = rng.choice([1, 2, 4])
    dp = rng.randint(1, 2)
    new_shape = even_plan(dp=dp, pp=rng.randint(1, 3), tp=tp, n_layers=cfg.n_layers, global_batch=2 * dp, micro_batch=1)
    pool = list(old.devices) + [100 + i for i in range(len(new_shape.devices))]
    new = relabel_plan(new_shape, dict(zip(new_shape.devices, rng.sample(pool, len(new_shape.devices)))))

    def kept(lay):
        return {n: s for n, s in lay.items() if n in keep}

    manifest = relayout(kept(layout(cfg, old)), kept(layout(cfg, new)), survivors=pool, bytes_per_element=1)
    sent: dict[int, int] = {}
    for m in manifest.moves:
        if not m.local:
            sent[m.dst] = sent.get(m.dst, 0) + m.nbytes
    params = UnitParams(*(sum(math.prod(shapes[n]) for n in names[u] if n in keep) for u in (0, EMBEDDING, cfg.n_layers)))
    lacking = geometry_of(new).lacking(geometry_of(old), params)
    assert {d: pytest.approx(e) for d, (e, _) in lacking.items()} == sent


def test_a_stage_rebuilt_from_the_shards_of_two_replicas():
    """The issue's case: dp2 × pp2 × tp2, devices 6 (stage 1, shard 0 of pipeline 1) and 3 (stage 1, shard 1 of
    pipeline 0) lost. Shard 0 lives on device 2, shard 1 on device 7: nothing is lost, and (2, 7) is a unit."""
    plan = even_plan(dp=2, pp=2, tp=2, n_layers=4, global_batch=8, micro_batch=2)
    g = geometry_of(plan)
    assert g.lost({3, 6}) == ()
    assert g.units(set(range(8)) - {3, 6}) == [(0, 1), (4, 5), (2, 7)]
    assert g.describe(g.lost({2, 6})) == "layers 2–3 (TP shard 0 of 2)"
    assert g.describe(g.lost({2, 3, 6, 7})) == "layers 2–3 and the head"
    assert g.describe(g.lost({0, 1, 4, 5, 3, 7})) == "the embedding and layers 0–1; layers 2–3 (TP shard 1 of 2)"
    # TP 4: shards 0..3 of pipeline 1's stage from devices 4, 1, 2, 7 once 0, 5, 6, 3 are partly gone
    tp4 = even_plan(dp=2, pp=1, tp=4, n_layers=4, global_batch=8, micro_batch=2)
    alive = {1, 2, 3, 4, 7}
    assert geometry_of(tp4).lost(set(range(8)) - alive) == ()
    assert geometry_of(tp4).units(alive) == [(4, 1, 2, 3)]


def test_units_keep_whole_stages_then_regroup():
    plan = even_plan(dp=3, pp=1, tp=2, n_layers=4, global_batch=6, micro_batch=1)  # (0, 1), (2, 3), (4, 5)
    g = geometry_of(plan)
    assert g.units(range(6)) == [(0, 1), (2, 3), (4, 5)]
    assert g.units({0, 2, 3, 5}) == [(2, 3), (0, 5)]  # 0 holds shard 0, 5 shard 1: a whole set
    assert g.units({0, 2, 3, 4}) == [(2, 3), (0, 4)]  # two shard 0s: in id order, a unit still
    assert g.units({0, 2, 3, 8, 9, 10}) == [(2, 3), (0, 8), (9, 10)]  # idle devices after the shard sets
    assert tp_units([5, 1, 3, 2, 9], 2) == [(1, 2), (3, 5)]


def test_buckets_rounds_and_elements():
    plan = plan_from_spec([{"layers": [2, 2], "micro_batches": 1}, {"layers": [1, 2, 1], "micro_batches": 1}],
                          tp=2, n_layers=4, global_batch=2, micro_batch=1)
    g = geometry_of(plan)
    assert [b.units for b in g.buckets] == [(-1, 0), (1,), (2,), (3, 4)]
    assert len(g.rounds) == 2  # {1} shares pipeline 0's stage 0 with {-1, 0} and pipeline 1's stage 1 with {2}
    params = UnitParams(layer=10, first=7, last=5)
    assert g.sync_size(0, params) == (2, 7 + 10 / 2) and g.sync_size(3, params) == (2, 10 / 2 + 5)


def test_state_bytes_are_what_the_runtime_keeps():
    """The table against a real stage's tensors: fp32 master, gradient and moments, and the bf16 forward copy."""
    from chameleon.runtime.worker.stage import KINDS, StageState, role_of

    cfg = ModelConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=20, multiple_of=8)
    plan = even_plan(dp=1, pp=1, tp=1, n_layers=2, global_batch=1, micro_batch=1)
    for dtype in ("fp32", "bf16"):
        train = TrainConfig(dtype=dtype)
        state = StageState.create(cfg, role_of(plan, 0), seed=0, train=train, device=torch.device("cpu"))
        sum(p.float().sum() for p in state.params.values()).backward()
        name = "layers.0.attention.wq"
        kept = {kind: state.tensors()[kind][name].element_size() for kind in KINDS}
        grad = state.grads([name])[0].element_size()
        copy = state.params[name].element_size() if dtype != "fp32" else 0
        table = state_bytes(dtype)
        assert (table.weight, table.moments, table.grad, table.copy) == (kept["param"], kept["exp_avg"] + kept["exp_avg_sq"],
                                                                       grad, copy)
        assert table.moved == sum(kept.values())  # what a transfer carries: every kind


def test_replicas_of_different_tp_sizes_sync_in_fine_shards():
    """tp2 and tp1 replicas of one model: one bucket of 2 fine shards; shard 1 lives while device 1 or device 2 does;
    the sync is one all-reduce of the whole tensors over all three devices, device 1 zeroing the copies it keeps whole."""
    plan = Plan(n_layers=4, micro_batch_size=1, pipelines=(Pipeline((Stage((0, 1), (0, 4)),), 1),
                                                           Pipeline((Stage((2,), (0, 4)),), 1)))
    g = Geometry(plan)
    (bucket,) = g.buckets
    assert bucket.mixed and bucket.tp == 2 and [g.holders(Part(0, t)) for t in (0, 1)] == [(0, 2), (1, 2)]
    assert g.lost({1}) == () and g.lost({1, 2}) == (Part(0, 1),) and g.exposure(None) == 0.0
    assert g.describe(g.lost({1, 2})) == "layers 0–3 (TP shard 1 of 2)"
    assert g.sync_size(0, UnitParams(layer=10, first=7, last=5)) == (3, 7 + 4 * 10 + 5)
    ((sync,),) = sync_rounds(g, layout(LLAMA_CFG_4, plan))
    assert sync.devices == (0, 1, 2) and sync.zeroed == (1,) and len(sync.shapes) == len(sync.names)
