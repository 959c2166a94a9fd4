"""The geometry of a plan: who holds every region of the model's state, derived once.

The state comes in model units: the embedding (unit −1, on each pipeline's first
stage), the layers ``0 … L−1`` and the head (unit ``L``: final norm and output, on
the last stage). A stage's TP group of ``tp`` devices cuts every layer into ``tp``
shards — device ``t`` of the mesh holds shard ``t`` (Megatron's column- and
row-parallel cuts) — and keeps the embedding and the head whole on every device
(the model specs' ``tp_rules``; ``tests/test_geometry.py`` checks each spec's layout
against this). Units held by the same stages form a :class:`Bucket`: one gradient
all-reduce per TP index, the buckets coloured into rounds of stage-disjoint ones.

Replicas may differ in TP degree (each pipeline its own). A bucket whose stages do is
cut into ``lcm`` of their degrees *fine* shards, fine shard ``t`` held by device
``t·tp_k // lcm`` of stage ``k``; its gradients are summed in one all-reduce over every
holder, each device placing its own regions in zeros of the whole tensors (and a copy
that every device of a stage keeps, from the stage's first device alone), so regions
that overlap are summed where they overlap and each replica counts once.

A *part* is TP shard ``t`` of a bucket: its layers' shard ``t`` and the copy of its
embedding or head that device ``t`` of each stage keeps; its holders are device
``t`` of each of the bucket's stages. A part is lost when all its holders failed;
an embedding or head is lost only when every part of its bucket is. So a layer
survives as long as each of its shards survives somewhere, on whichever replica.

:class:`Geometry` (built once per plan by :func:`geometry_of`) answers everything
that asks who holds what: the lost parts of a failed set (and a line naming them),
the share of fault domains that would lose one, the survivors regrouped into stage
units, each device's holding and the elements it lacks from an older plan, the sync
buckets and rounds; the runtime's tensor-level sync groups (:func:`sync_rounds`) and
checkpoint writers (:func:`writers`) are projections of it. Bytes per element come
from one table, :class:`StateBytes`. Holders and losses are exact (tested against
the layouts' shards); element counts treat a layer's small replicated tensors (its
norms) as sharded, as the memory model does. Pure functions; nothing touches a process.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
import math
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache
from typing import NamedTuple

import numpy as np

from chameleon.layout.colouring import SyncGroup, conflict_colours
from chameleon.layout.plan import Plan, Stage
from chameleon.layout.spec import Layout, Region, region_numel, shard_region

EMBEDDING = -1
"""The embedding's unit id; layers are ``0 … L−1`` and the head is ``L``."""

ELEMENT_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per element of each compute dtype (``train.dtype``)."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each part of the training state, as the runtime keeps it.

    Whatever the compute dtype, the master weight, its gradient (what the DP sync
    all-reduces) and AdamW's two moments are fp32; ``bf16`` adds a copy of the weight
    for the forward. A re-layout moves, and a checkpoint stores, the weight and moments.
    """

    weight: int
    grad: int
    moments: int
    copy: int

    @property
    def resident(self) -> int:
        """Bytes a device keeps per parameter it holds."""
        return self.weight + self.grad + self.moments + self.copy

    @property
    def moved(self) -> int:
        """Bytes per parameter a re-layout sends and a checkpoint stores."""
        return self.weight + self.moments


@cache
def state_bytes(dtype: str) -> StateBytes:
    """The :class:`StateBytes` of compute dtype ``dtype`` (``train.dtype``)."""
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"train.dtype={dtype!r}: use one of {sorted(ELEMENT_BYTES)}")
    fp32 = ELEMENT_BYTES["fp32"]
    return StateBytes(weight=fp32, grad=fp32, moments=2 * fp32, copy=0 if dtype == "fp32" else ELEMENT_BYTES[dtype])


MIGRATE_BYTES = state_bytes("fp32").moved
"""Bytes per parameter a device fetches to take one over (any dtype: the weight and moments are fp32)."""


class LostStateError(RuntimeError):
    """No survivor holds some region a layout needs: only a checkpoint can restore it."""


class UnitParams(NamedTuple):
    """A per-unit quantity (elements, or activation bytes) of one layer, the embedding and the head, whole."""

    layer: float
    first: float
    last: float

    def of(self, unit: int, n_layers: int) -> float:
        """The quantity of model unit ``unit``."""
        return self.first if unit == EMBEDDING else self.last if unit == n_layers else self.layer


def per_device(parts: UnitParams, n_layers: int, *, first: bool, last: bool, tp: int) -> float:
    """One device's share of a ``tp``-wide stage of ``n_layers`` layers: a ``1/tp`` shard of each layer, the
    embedding (``first``) and the head (``last``) whole."""
    return n_layers * parts.layer / tp + first * parts.first + last * parts.last


class Holding(NamedTuple):
    """What one device holds: units ``lo … hi−1`` (−1 the embedding, ``L`` the head, when its stage has them),
    each layer's TP shard ``shard`` of ``tp``, the embedding and head whole."""

    lo: int
    hi: int
    shard: int
    tp: int

    def sizes(self, params: UnitParams, n_layers: int) -> np.ndarray:
        """Elements held of each model unit (index ``u + 1``): a ``1/tp`` shard of a layer, the embedding or head whole."""
        out = np.zeros(n_layers + 2)
        out[self.lo + 1:self.hi + 1] = params.layer / self.tp
        for end, size in ((EMBEDDING, params.first), (n_layers, params.last)):
            if self.lo <= end < self.hi:
                out[end + 1] = size
        return out

    def lacks(self, have: Holding | None, params: UnitParams, n_layers: int) -> tuple[float, int]:
        """Elements of this holding that a device holding ``have`` (None: nothing) lacks, and in how many units."""
        mask = np.zeros(n_layers + 2)
        mask[self.lo + 1:self.hi + 1] = 1
        uncovered = mask * (1 - coverage(have, self.shard, self.tp, n_layers))
        return float(self.sizes(params, n_layers) @ uncovered), int(np.count_nonzero(uncovered > 1e-12))


@lru_cache(maxsize=4096)
def coverage(have: Holding | None, shard: int, tp: int, n_layers: int) -> np.ndarray:
    """Per model unit (index ``u + 1``), the share of what device ``shard`` of a ``tp``-wide stage holds of it that a
    device holding ``have`` (None: nothing) holds too: its layers' shards' overlap, 1 for an embedding or head."""
    out = np.zeros(n_layers + 2)
    if have is not None:
        out[have.lo + 1:have.hi + 1] = 1.0
        lo, hi = max(shard / tp, have.shard / have.tp), min((shard + 1) / tp, (have.shard + 1) / have.tp)
        out[max(have.lo, 0) + 1:min(have.hi, n_layers) + 1] = max(0.0, hi - lo) * tp
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class Bucket:
    """Model units (in model order) held by the same live stages (ids into :attr:`Geometry.stages`); ``tp``: its
    shards, the stages' TP size, or the lcm of their sizes where they differ (``mixed``: fine shards)."""

    units: tuple[int, ...]
    stages: tuple[int, ...]
    tp: int
    mixed: bool = False


class Part(NamedTuple):
    """TP shard ``shard`` of bucket ``bucket`` (see the module doc)."""

    bucket: int
    shard: int


class Geometry:
    """Who holds what under ``plan`` (see the module doc). Build it with :func:`geometry_of`.

    Attributes:
        stages: the plan's stages that have devices, in pipeline-then-stage order.
        buckets: the sync buckets, in model order of their first unit.
        rounds: bucket ids of the buckets held by ≥ 2 stages, coloured into rounds of stage-disjoint ones.
        width: the plan's TP size (the widest stage).

    """

    def __init__(self, plan: Plan):
        self.plan, self.n_layers = plan, plan.n_layers
        live = [(st, s == 0, s == p.n_stages - 1) for p in plan.pipelines for s, st in enumerate(p.stages) if st.devices]
        self.stages: tuple[Stage, ...] = tuple(st for st, _, _ in live)
        self._units = [(st.layers[0] - first, st.layers[1] + last) for st, first, last in live]
        self.width = max((st.tp for st in self.stages), default=1)
        held_by: list[list[int]] = [[] for _ in range(plan.n_layers + 2)]  # unit u at index u + 1
        for k, (lo, hi) in enumerate(self._units):
            for u in range(lo, hi):
                held_by[u + 1].append(k)
        grouped: dict[tuple[int, ...], list[int]] = {}
        for u, holders in enumerate(held_by, start=EMBEDDING):
            grouped.setdefault(tuple(holders), []).append(u)
        buckets = []
        for stages, units in grouped.items():
            tps = {self.stages[k].tp for k in stages}
            buckets.append(Bucket(tuple(units), stages, math.lcm(*tps) if tps else 1, len(tps) > 1))
        self.buckets = tuple(buckets)
        self.of_stage: list[list[int]] = [[] for _ in self.stages]
        for b, bucket in enumerate(buckets):
            for k in bucket.stages:
                self.of_stage[k].append(b)
        syncing = [b for b, bucket in enumerate(buckets) if len(bucket.stages) > 1]
        colours = conflict_colours([buckets[b].stages for b in syncing])
        self.rounds = tuple(tuple(b for b, c in zip(syncing, colours) if c == r) for r in range(max(colours, default=-1) + 1))

    # ----- who holds what ---------------------------------------------------------------

    @cached_property
    def seat(self) -> dict[int, tuple[int, int]]:
        """Every device of the plan → ``(stage id, TP index)``."""
        return {d: (k, t) for k, st in enumerate(self.stages) for t, d in enumerate(st.devices)}

    def holding(self, device: int) -> Holding | None:
        """What ``device`` holds under the plan (None: it holds nothing)."""
        if device not in self.seat:
            return None
        k, t = self.seat[device]
        return Holding(*self._units[k], t, self.stages[k].tp)

    def holders(self, part: Part) -> tuple[int, ...]:
        """The devices holding ``part`` (a fine shard of a mixed bucket: the device of each stage whose shard holds it)."""
        bucket = self.buckets[part.bucket]
        return tuple(self.stages[k].devices[part.shard * self.stages[k].tp // bucket.tp] for k in bucket.stages)

    def shards_of(self, device: int, bucket: int) -> range:
        """The (fine) shards of ``bucket`` that ``device`` holds."""
        k, t = self.seat[device]
        per = self.buckets[bucket].tp // self.stages[k].tp
        return range(t * per, (t + 1) * per)

    def sync_size(self, bucket: int, params: UnitParams) -> tuple[int, float]:
        """Devices and elements per device of ``bucket``'s gradient all-reduce: one per TP index over a device of each
        stage, its shard; or, mixed, one over every holder, the whole units."""
        b = self.buckets[bucket]
        layers = sum(0 <= u < self.n_layers for u in b.units)
        first, last = EMBEDDING in b.units, self.n_layers in b.units
        if b.mixed:
            return sum(self.stages[k].tp for k in b.stages), per_device(params, layers, first=first, last=last, tp=1)
        return len(b.stages), per_device(params, layers, first=first, last=last, tp=b.tp)

    # ----- faults -----------------------------------------------------------------------

    def lost(self, failed: Collection[int]) -> tuple[Part, ...]:
        """The parts with no holder once ``failed`` devices are gone, in bucket then shard order."""
        dead = set(failed)
        touched = {b for d in dead if d in self.seat for b in self.of_stage[self.seat[d][0]]}
        touched |= {b for b, bucket in enumerate(self.buckets) if not bucket.stages}
        return tuple(
            Part(b, t) for b in sorted(touched) for t in range(self.buckets[b].tp)
            if dead.issuperset(self.holders(Part(b, t)))
        )

    def describe(self, parts: Iterable[Part]) -> str:
        """A line naming what ``parts`` hold, e.g. ``layers 2–3 (TP shard 1 of 2); the embedding and layers 0–1``.

        A bucket all of whose parts are named is named whole, its embedding or head
        included; otherwise its layers and the shards of them. ``nothing`` when empty.
        """
        shards: dict[int, list[int]] = {}
        for b, t in parts:
            shards.setdefault(b, []).append(t)
        out = []
        for b, ts in sorted(shards.items()):
            bucket = self.buckets[b]
            if len(ts) == bucket.tp:
                out.append(self.name_units(bucket.units))
            else:
                layers = [u for u in bucket.units if 0 <= u < self.n_layers]
                out.append(f"{self.name_units(layers)} (TP shard{'s' * (len(ts) > 1)} "
                           f"{', '.join(map(str, sorted(ts)))} of {bucket.tp})")
        return "; ".join(out) or "nothing"

    def name_units(self, units: Iterable[int]) -> str:
        """``the embedding, layers 0–3 and the head``-style names of model units."""
        units = sorted(units)
        layers = [u for u in units if 0 <= u < self.n_layers]
        runs: list[list[int]] = []
        for u in layers:
            if runs and runs[-1][-1] == u - 1:
                runs[-1].append(u)
            else:
                runs.append([u])
        names = ["the embedding"] if EMBEDDING in units else []
        names += [f"layer {r[0]}" if len(r) == 1 else f"layers {r[0]}–{r[-1]}" for r in runs]
        names += ["the head"] if self.n_layers in units else []
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]

    def exposure(self, domains: Iterable[Collection[int]] | None) -> float:
        """Share of ``domains`` (None: each device of the plan) holding every holder of some part.

        That is the chance that the next fault, one domain going down, takes state
        no survivor holds. Each domain counts only the parts its devices hold.
        """
        groups = [(d,) for d in self.seat] if domains is None else [g for g in domains if g]
        if not groups:
            return 0.0
        if any(not bucket.stages for bucket in self.buckets):
            return 1.0
        fewest = min(len(bucket.stages) for bucket in self.buckets)  # a part has a holder on each of its stages

        def wipes(group: Collection[int]) -> bool:
            count: dict[Part, int] = {}
            for d in group:
                if d in self.seat:
                    for b in self.of_stage[self.seat[d][0]]:
                        for t in self.shards_of(d, b):
                            n = count[Part(b, t)] = count.get(Part(b, t), 0) + 1
                            if n == len(self.buckets[b].stages):
                                return True
            return False

        return sum(len(group) >= fewest and wipes(group) for group in groups) / len(groups)

    # ----- survivors --------------------------------------------------------------------

    def units(self, alive: Iterable[int]) -> list[tuple[int, ...]]:
        """The live devices as stage units (TP groups of :attr:`width`) a re-plan may use.

        A stage all of whose devices live stays a unit as it is. The other live
        devices — survivors of broken stages and devices the plan leaves idle — are
        regrouped: first into whole shard sets of one stage's state (device ``t``
        holding shard ``t``; lowest ids first), which rebuild that stage without moving
        state, then in id order (:func:`tp_units`); fewer than a width left over idle.
        """
        live = set(alive)
        whole = [st.devices for st in self.stages if st.tp == self.width and live.issuperset(st.devices)]
        rest = sorted(live.difference(*whole))
        sets: dict[tuple[int, int], list[list[int]]] = {}
        loose = []
        for d in rest:
            seat = self.seat.get(d)
            if seat is None or self.stages[seat[0]].tp != self.width:
                loose.append(d)
            else:
                sets.setdefault(self._units[seat[0]], [[] for _ in range(self.width)])[seat[1]].append(d)
        regrouped = []
        for shards in sets.values():
            n = min(map(len, shards))
            regrouped += list(zip(*(s[:n] for s in shards)))
            loose += [d for s in shards for d in s[n:]]
        return whole + regrouped + tp_units(loose, self.width)

    def lacking(self, old: Geometry, params: UnitParams) -> dict[int, tuple[float, int]]:
        """Per device of this plan, the elements it must fetch because it did not hold them under ``old``, and in
        how many units (devices lacking nothing left out)."""
        out, seen = {}, {}
        for d in self.seat:
            key = (self.holding(d), old.holding(d))
            if key not in seen:
                seen[key] = key[0].lacks(key[1], params, self.n_layers)
            if seen[key][1]:
                out[d] = seen[key]
        return out


@lru_cache(maxsize=64)
def geometry_of(plan: Plan) -> Geometry:
    """The :class:`Geometry` of ``plan``, built once and cached."""
    return Geometry(plan)


def tp_units(devices: Iterable[int], width: int) -> list[tuple[int, ...]]:
    """Devices that hold no state to keep, as stage units of ``width`` consecutive ids (a partial one left out)."""
    ids = sorted(devices)
    return [tuple(ids[i:i + width]) for i in range(0, len(ids) - len(ids) % width, width)]


# ----- tensor-level projections for the runtime -------------------------------------------


def sync_rounds(geometry: Geometry, layout: Layout) -> tuple[tuple[SyncGroup, ...], ...]:
    """The runtime's gradient sync: every round's buckets, each one all-reduce per TP index ``t`` over device ``t``
    of its stages, carrying the layout's tensors of its units — or, a bucket of mixed TP sizes, one all-reduce of
    the whole tensors over every holder (see the module doc; the stages' devices but their first zeroed).

    Every rank runs the rounds, and the groups within a round, in this order, so
    process groups and collectives line up everywhere. ``layout`` is the plan's.
    """
    bucket_of = {b.stages: i for i, b in enumerate(geometry.buckets)}
    names: list[list[str]] = [[] for _ in geometry.buckets]
    for spec in layout.values():
        if spec.holders:
            names[bucket_of[tuple(geometry.seat[h.devices[0]][0] for h in spec.holders)]].append(spec.name)
    def groups(b: int) -> list[SyncGroup]:
        bucket = geometry.buckets[b]
        if not bucket.mixed:
            return [SyncGroup(tuple(sorted(geometry.holders(Part(b, t)))), tuple(names[b])) for t in range(bucket.tp)]
        stages = [geometry.stages[k].devices for k in bucket.stages]
        return [SyncGroup(tuple(sorted(d for devices in stages for d in devices)), tuple(names[b]),
                          tuple(layout[n].shape for n in names[b]), tuple(sorted(d for ds in stages for d in ds[1:])))]

    return tuple(tuple(g for b in round_ for g in groups(b)) for round_ in geometry.rounds)


def writers(layout: Layout) -> dict[int, dict[str, Region]]:
    """Who writes what: each tensor's distinct non-empty shards on its first holder.

    The first holder's shards tile a tensor, so the writers' regions cover every
    tensor exactly once; a replicated tensor is written by the holder's first device.

    Returns:
        ``{device: {name: region}}``, devices that write nothing left out.

    Raises:
        LostStateError: a tensor has no holder, so no checkpoint of this layout is whole.
    """
    out: dict[int, dict[str, Region]] = {}
    for spec in layout.values():
        if not spec.holders:
            raise LostStateError(f"no device holds {spec.name}: a checkpoint of this layout would lack it")
        holder = spec.holders[0]
        written: set[Region] = set()
        for t, device in enumerate(holder.devices):
            region = shard_region(spec.shape, holder.placements, t, len(holder.devices))
            if region_numel(region) and region not in written:
                written.add(region)
                out.setdefault(device, {})[spec.name] = region
    return out


def replica_groups(holdings: Mapping[int, Mapping[str, Region]]) -> tuple[tuple[int, ...], ...]:
    """The devices that hold exactly the same regions of exactly the same tensors, in groups of two or more: the
    replicas whose state must agree byte for byte after every optimizer step. ``holdings``: each device's regions
    (:func:`~chameleon.layout.spec.device_holdings`; devices that share one dict, as
    :func:`~chameleon.layout.spec.stage_holdings` gives them, are compared once)."""
    keys: dict[int, tuple] = {}  # by the id of a device's dict
    by_holdings: dict[tuple, list[int]] = {}
    for device, held in sorted(holdings.items()):
        if id(held) not in keys:
            keys[id(held)] = tuple(sorted(held.items()))
        by_holdings.setdefault(keys[id(held)], []).append(device)
    return tuple(tuple(group) for group in by_holdings.values() if len(group) > 1)
