"""Layouts: which devices hold which region of every named tensor under a plan.

Sharding is data. A small rule table, the model spec's ``tp_rules``, maps
parameter-name patterns to DTensor placements on a stage's TP mesh (column-parallel
projections ``Shard(0)``, row-parallel ones ``Shard(1)``, everything else
``Replicate()``); :func:`layout_of` applies it to every stage of a plan. Shards
follow ``torch.chunk`` (ceil-div chunks, trailing ranks possibly empty), exactly as
DTensor splits a tensor, so a device's region here is the local tensor DTensor would
give it. TP = 1 is the degenerate case: every placement covers the whole tensor.

A region is a box: one half-open ``(start, stop)`` range per tensor dimension.
Nothing here touches a process group or the model; the model supplies names and
shapes from outside.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from chameleon.layout.plan import Plan

Region = tuple[tuple[int, int], ...]
Rules = tuple[tuple[str, tuple[Placement, ...]], ...]
"""A model spec's ``tp_rules``: ``(full-name regex, placements on the stage's 1-D TP mesh)``, first match wins."""


class StageNames(Protocol):
    """The parameter names a stage holds, e.g. the model's ``stage_param_names`` with its config bound."""

    def __call__(self, layers: tuple[int, int], *, first: bool, last: bool) -> Iterable[str]: ...


@dataclass(frozen=True)
class Holder:
    """One stage's copy of a tensor: its TP mesh (devices in mesh order) and placements on it."""

    devices: tuple[int, ...]
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor's global shape and every stage that holds it (none when all died)."""

    name: str
    shape: tuple[int, ...]
    holders: tuple[Holder, ...]


Layout = dict[str, TensorSpec]


def placements_for(name: str, *, rules: Rules) -> tuple[Placement, ...]:
    """The placements of the first rule whose pattern matches the whole name.

    Raises:
        ValueError: no rule matches (a new parameter needs a rule, never a silent default).
    """
    for pattern, placements in rules:
        if re.fullmatch(pattern, name):
            return placements
    raise ValueError(f"no sharding rule matches tensor {name!r}: add a (pattern, placements) rule for it")


def layout_of(
    plan: Plan,
    shapes: Mapping[str, tuple[int, ...]],
    stage_names: StageNames,
    *,
    rules: Rules,
) -> Layout:
    """Every named tensor of the plan with its shape and holders, in pipeline-then-stage order.

    Args:
        plan: the plan; its stage devices may be physical devices or logical slots.
        shapes: global shape of every tensor name.
        stage_names: names held by a stage, given its layer range and whether it is first/last.
        rules: name pattern → placements on the stage's TP mesh.

    Returns:
        ``{name: TensorSpec}``. A stage without devices contributes its names but no holder. Tensors held by the
        same stages with the same placements share one tuple of holders.
    """
    shaped = _StageShapes(plan, shapes, stage_names)
    at: dict[tuple, list[int]] = {}  # stage shape → its stages with devices
    for i, (stage, key) in enumerate(zip(shaped.stages, shaped.keys)):
        if stage.devices:
            at.setdefault(key, []).append(i)
    keys_of: dict[str, list[tuple]] = {}
    for key, names in shaped.names.items():
        for name in names:
            keys_of.setdefault(name, []).append(key)
    held: dict[tuple, list[int]] = {}  # the shapes holding a tensor → their stages with devices, in order
    holders: dict[tuple, tuple[Holder, ...]] = {}
    out: Layout = {}
    for name in shaped.order:
        keys = tuple(keys_of[name])
        if keys not in held:
            held[keys] = sorted(i for key in keys for i in at.get(key, ()))
        placements = placements_for(name, rules=rules) if held[keys] else ()
        if (keys, placements) not in holders:
            holders[keys, placements] = tuple(Holder(shaped.stages[i].devices, placements) for i in held[keys])
        out[name] = TensorSpec(name, tuple(shapes[name]), holders[keys, placements])
    return out


def stage_holdings(
    plan: Plan,
    shapes: Mapping[str, tuple[int, ...]],
    stage_names: StageNames,
    *,
    rules: Rules,
) -> dict[int, dict[str, Region]]:
    """``device_holdings(layout_of(plan, ...))``, found once per stage shape and TP index: the devices that hold
    the same regions share one dict (read it, never change it)."""
    shaped = _StageShapes(plan, shapes, stage_names)
    placed = functools.cache(lambda name: placements_for(name, rules=rules))
    shared: dict[tuple, dict[str, Region]] = {}
    seats = []  # (where the device first appears in the layout's order, device, its regions)
    for i, (stage, key) in enumerate(zip(shaped.stages, shaped.keys)):
        tp = len(stage.devices)
        for t, device in enumerate(stage.devices):
            if (key, t, tp) not in shared:
                shared[key, t, tp] = {name: shard_region(tuple(shapes[name]), placed(name), t, tp)
                                      for name in shaped.names[key]}
            seats.append((shaped.first[key], i, t, device, shared[key, t, tp]))
    seats.sort(key=lambda seat: seat[:3])
    return {device: regions for *_, device, regions in seats}


class _StageShapes:
    """A plan's stages (pipeline-then-stage order), each one's shape ``(layers, first, last)``, each shape's
    tensor names in the layout's order (a name's first stage first) and where its first name comes in it."""

    def __init__(self, plan: Plan, shapes: Mapping[str, tuple[int, ...]], stage_names: StageNames):
        self.stages = [stage for pipeline in plan.pipelines for stage in pipeline.stages]
        self.keys = [(stage.layers, s == 0, s == pipeline.n_stages - 1)
                     for pipeline in plan.pipelines for s, stage in enumerate(pipeline.stages)]
        self.order: dict[str, int] = {}
        names: dict[tuple, list[str]] = {}
        for key in self.keys:
            if key not in names:
                names[key] = list(stage_names(key[0], first=key[1], last=key[2]))
                for name in names[key]:
                    if name not in shapes:
                        raise ValueError(f"tensor {name!r} of stage layers {key[0]} has no entry in shapes")
                    self.order.setdefault(name, len(self.order))
        self.names = {key: sorted(ns, key=self.order.__getitem__) for key, ns in names.items()}
        self.first = {key: self.order[ns[0]] if ns else len(self.order) for key, ns in self.names.items()}


def shard_region(shape: tuple[int, ...], placements: tuple[Placement, ...], tp_index: int, tp: int) -> Region:
    """The region rank ``tp_index`` of a ``tp``-device 1-D mesh holds, with DTensor's chunking.

    ``Shard(d)`` cuts dim ``d`` into ``ceil(n / tp)``-sized chunks as ``torch.chunk``
    does (trailing ranks may get an empty range); ``Replicate()`` holds everything.
    """
    if len(placements) != 1:
        raise ValueError(f"placements {placements} are for a {len(placements)}-D mesh; a stage's TP mesh is 1-D")
    if not 0 <= tp_index < tp:
        raise ValueError(f"tp_index={tp_index} is outside a mesh of {tp} devices")
    region = [(0, n) for n in shape]
    (placement,) = placements
    if isinstance(placement, Shard):
        n = shape[placement.dim]
        chunk = -(-n // tp)
        start = min(tp_index * chunk, n)
        region[placement.dim] = (start, min(start + chunk, n))
    elif not isinstance(placement, Replicate):
        raise ValueError(f"placement {placement} is not supported in a layout: use Shard or Replicate")
    return tuple(region)


def device_holdings(layout: Layout) -> dict[int, dict[str, Region]]:
    """Per device, the region of every tensor it holds (one shard per tensor: a device runs one stage)."""
    holdings: dict[int, dict[str, Region]] = {}
    regions: dict[tuple, Region] = {}  # holders of one tensor share their TP cuts: each is found once
    for spec in layout.values():
        for holder in spec.holders:
            tp = len(holder.devices)
            for t, device in enumerate(holder.devices):
                key = (spec.shape, holder.placements, t, tp)
                if key not in regions:
                    regions[key] = shard_region(spec.shape, holder.placements, t, tp)
                holdings.setdefault(device, {})[spec.name] = regions[key]
    return holdings


def region_shape(region: Region) -> tuple[int, ...]:
    """The shape of the tensor holding exactly ``region``."""
    return tuple(stop - start for start, stop in region)


def region_numel(region: Region) -> int:
    """The number of elements in ``region``."""
    return math.prod(region_shape(region))


def intersect(a: Region, b: Region) -> Region | None:
    """The common part of two regions of the same tensor, or ``None`` when it is empty."""
    common = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return common if all(start < stop for start, stop in common) else None


def contains(outer: Region, inner: Region) -> bool:
    """True when ``inner`` lies inside ``outer``."""
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def local_slices(region: Region, origin: Region) -> tuple[slice, ...]:
    """Index ``region`` inside a local tensor that holds ``origin`` (which must contain it)."""
    if not contains(origin, region):
        raise ValueError(f"region {region} is not inside the held region {origin}")
    return tuple(slice(r0 - o0, r1 - o0) for (r0, r1), (o0, _) in zip(region, origin, strict=True))
