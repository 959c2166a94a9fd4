"""Gradient-sync groups for (possibly uneven) pipelines, coloured into rounds.

Every tensor is all-reduced over the devices that hold it across pipelines. With
TP > 1 each holder is a TP mesh and rank ``t`` of one mesh holds the same shard as
rank ``t`` of every other, so the tensor yields one group per TP index ``t``:
``{mesh[t] for mesh in holders}`` (replicated tensors, such as norms, are
synced the same way; TP ranks of a stage compute identical gradients for them).
Tensors sharing a device set are bucketed into one group. Groups that share a
device cannot run at once, so the conflict graph is coloured and each colour is a
round of device-disjoint all-reduces. In an even plan the groups are the per-stage
(per TP index) DP groups, pairwise disjoint: one round, ordinary DP sync.

The colouring is our own DSATUR rather than ``networkx.greedy_color``: networkx
is only a transitive dependency of torch, and an explicit tie-break (saturation,
then degree, then vertex order) makes the rounds a documented function of the
plan, identical on every rank whatever library versions are installed. DSATUR is
exact on bipartite graphs and close to optimal on the small graphs plans produce.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from chameleon.layout.spec import Layout


@dataclass(frozen=True)
class SyncGroup:
    """One all-reduce: its devices (sorted) and the tensors bucketed into it (layout order)."""

    devices: tuple[int, ...]
    names: tuple[str, ...]


def dsatur(adjacency: Sequence[Collection[int]]) -> list[int]:
    """Colour a graph so that neighbours differ, by DSATUR with a deterministic tie-break.

    Repeatedly colours the uncoloured vertex with the most distinct neighbour
    colours, then the highest degree, then the lowest index, with the smallest
    colour none of its neighbours has. Callers order vertices by priority.

    Args:
        adjacency: ``adjacency[v]`` holds the neighbours of vertex ``v``.

    Returns:
        The colour (0, 1, ...) of every vertex.
    """
    colours = [-1] * len(adjacency)
    seen: list[set[int]] = [set() for _ in adjacency]
    for _ in adjacency:
        v = max(
            (u for u, c in enumerate(colours) if c < 0),
            key=lambda u: (len(seen[u]), len(adjacency[u]), -u),
        )
        colour = next(c for c in range(len(adjacency)) if c not in seen[v])
        colours[v] = colour
        for u in adjacency[v]:
            seen[u].add(colour)
    return colours


def sync_groups(layout: Layout) -> tuple[SyncGroup, ...]:
    """One group per distinct holder set (per TP index), in order of first tensor, then TP index.

    Tensors held by a single device need no sync and yield no group.

    Raises:
        ValueError: holders of one tensor have different TP sizes (their shards do not line up).
    """
    buckets: dict[tuple[int, ...], list[str]] = {}
    for spec in layout.values():
        tps = {len(h.devices) for h in spec.holders}
        if len(tps) > 1:
            raise ValueError(f"holders of {spec.name!r} have TP sizes {sorted(tps)}: gradient sync needs one TP size")
        for t in range(tps.pop() if tps else 0):
            devices = tuple(sorted(h.devices[t] for h in spec.holders))
            if len(devices) > 1:
                buckets.setdefault(devices, []).append(spec.name)
    return tuple(SyncGroup(devices, tuple(names)) for devices, names in buckets.items())


def sync_rounds(layout: Layout) -> tuple[tuple[SyncGroup, ...], ...]:
    """The sync groups coloured into rounds of device-disjoint all-reduces, in a fixed order.

    Every rank runs the rounds in this order and, within a round, the groups in
    :func:`sync_groups` order, so process groups and collectives line up everywhere.
    """
    groups = sync_groups(layout)
    colours = conflict_colours([g.devices for g in groups])
    n_rounds = max(colours, default=-1) + 1
    return tuple(tuple(g for g, c in zip(groups, colours) if c == r) for r in range(n_rounds))


def conflict_colours(groups: Sequence[Collection[int]]) -> list[int]:
    """:func:`dsatur` colours of groups (sets of members, in priority order) that conflict when they share one.

    The runtime colours its sync groups with it, and the estimator the same groups of a plan.
    """
    by_member: dict[int, list[int]] = {}
    for i, members in enumerate(groups):
        for m in members:
            by_member.setdefault(m, []).append(i)
    return dsatur([{j for m in members for j in by_member[m] if j != i} for i, members in enumerate(groups)])
