"""Colouring conflicting groups into rounds: the gradient sync's and the re-layout's.

Every tensor is all-reduced over the devices that hold it across pipelines, one
group per TP index (:mod:`chameleon.layout.geometry` buckets the tensors held by
the same stages). Groups that share a member cannot run at once, so the conflict
graph is coloured and each colour is a round of disjoint all-reduces. In an even
plan the groups are the per-stage (per TP index) DP groups, pairwise disjoint: one
round, ordinary DP sync. The re-layout colours its point-to-point links the same way.

The colouring is our own DSATUR rather than ``networkx.greedy_color``: networkx
is only a transitive dependency of torch, and an explicit tie-break (saturation,
then degree, then vertex order) makes the rounds a documented function of the
plan, identical on every rank whatever library versions are installed. DSATUR is
exact on bipartite graphs and close to optimal on the small graphs plans produce.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SyncGroup:
    """One all-reduce: its devices (sorted) and the tensors bucketed into it (layout order). Holders of different TP
    sizes sum the whole tensors (``shapes``), each placing its own regions in zeros; a device in ``zeroed`` places
    a tensor it holds whole as zeros (its stage's first device adds that copy)."""

    devices: tuple[int, ...]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...] | None = None
    zeroed: tuple[int, ...] = ()


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


def conflict_colours(groups: Sequence[Collection[int]]) -> list[int]:
    """:func:`dsatur` colours of groups (sets of members, in priority order) that conflict when they share one."""
    by_member: dict[int, list[int]] = {}
    for i, members in enumerate(groups):
        for m in members:
            by_member.setdefault(m, []).append(i)
    return dsatur([{j for m in members for j in by_member[m] if j != i} for i, members in enumerate(groups)])
