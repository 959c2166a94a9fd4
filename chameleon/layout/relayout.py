"""Re-layout: the moves that turn what the survivors hold into what a new plan needs.

The planner places a new plan's stages on surviving devices so that the state
to fetch is minimal (the paper's Fig. 3, ``chameleon.decision.planner.place``);
:func:`relabel_plan` rewrites a plan onto other devices. :func:`relayout` then
lists, for every region a device needs, where it comes from:

- Each needed region is cut along the shard boundaries of the surviving holders,
  so with a TP change a shard is assembled from every source shard it intersects.
- A piece the receiving device already holds is a *local* move (``src == dst``,
  no bytes on the wire); they are listed so that the moves into a device tile its
  new regions exactly once.
- Otherwise the least-loaded surviving holder sends it (bytes sent so far, then
  lowest device id), spreading the load over DP replicas.
- Wire moves are grouped by (src, dst) link and the links coloured into rounds
  in which a device sends on at most one link and receives on at most one
  (links are full duplex); everything between two devices goes in one round.

Nothing here touches a process group; :mod:`chameleon.runtime.transfer` executes
a manifest.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from chameleon.layout.colouring import dsatur
from chameleon.layout.geometry import MIGRATE_BYTES, LostStateError
from chameleon.layout.plan import Plan, validate_plan
from chameleon.layout.spec import (
    Layout,
    Region,
    contains,
    device_holdings,
    intersect,
    region_numel,
)


@dataclass(frozen=True)
class Move:
    """Copy ``region`` (global coordinates) of tensor ``name`` from device ``src`` to ``dst``."""

    name: str
    region: Region
    src: int
    dst: int
    nbytes: int

    @property
    def local(self) -> bool:
        """True for a copy within one device (no bytes on the wire)."""
        return self.src == self.dst


@dataclass(frozen=True)
class Manifest:
    """Everything needed to go from the survivors' state to the new layout's.

    Attributes:
        local: moves within a device, run before any round.
        rounds: wire moves, run round by round; in a round a device sends on at most
            one link and receives on at most one, and each link's moves are listed together.
        before: each survivor's regions before the move (absent: holds nothing).
        after: each device's regions in the new layout.
    """

    local: tuple[Move, ...]
    rounds: tuple[tuple[Move, ...], ...]
    before: dict[int, dict[str, Region]]
    after: dict[int, dict[str, Region]]

    @property
    def moves(self) -> tuple[Move, ...]:
        """Local moves, then the wire moves in round order."""
        return self.local + tuple(itertools.chain.from_iterable(self.rounds))

    @property
    def wire_bytes(self) -> int:
        """Bytes sent between devices."""
        return sum(self.round_bytes)

    @property
    def round_bytes(self) -> tuple[int, ...]:
        """Total bytes sent in each round."""
        return tuple(sum(m.nbytes for m in moves) for moves in self.rounds)

    @property
    def round_link_bytes(self) -> tuple[int, ...]:
        """Bytes on the busiest link of each round; a round lasts as long as its slowest link."""
        out = []
        for moves in self.rounds:
            links: dict[tuple[int, int], int] = {}
            for m in moves:
                links[m.src, m.dst] = links.get((m.src, m.dst), 0) + m.nbytes
            out.append(max(links.values()))
        return tuple(out)


def relabel_plan(plan: Plan, mapping: Mapping[int, int]) -> Plan:
    """The plan with every stage device ``d`` replaced by ``mapping[d]``."""
    pipelines = tuple(
        replace(p, stages=tuple(replace(s, devices=tuple(mapping[d] for d in s.devices)) for s in p.stages))
        for p in plan.pipelines
    )
    relabelled = replace(plan, pipelines=pipelines)
    validate_plan(relabelled)
    return relabelled


def relayout(
    old_layout: Layout,
    new_layout: Layout,
    *,
    survivors: Iterable[int],
    bytes_per_element: int = MIGRATE_BYTES,
) -> Manifest:
    """The manifest that builds ``new_layout`` from what the survivors hold in ``old_layout``.

    Args:
        old_layout: the layout before the fault (dead devices included; they are skipped).
        new_layout: the layout to reach, on physical devices, all of them survivors.
        survivors: live devices, including incoming empty ones.
        bytes_per_element: bytes moved per tensor element.

    Raises:
        ValueError: the new layout uses a device that is not a survivor.
        LostStateError: some needed region has no surviving holder.
    """
    alive = sorted(set(survivors))
    old = device_holdings(old_layout)
    before = {d: old[d] for d in alive if d in old}
    after = device_holdings(new_layout)
    strangers = sorted(set(after) - set(alive))
    if strangers:
        raise ValueError(f"the new layout uses devices {strangers}, which are not survivors")
    sources: dict[str, dict[int, Region]] = {}
    for device, held in before.items():
        for name, region in held.items():
            sources.setdefault(name, {})[device] = region
    sent = dict.fromkeys(alive, 0)
    moves: list[Move] = []
    for dst in sorted(after):
        for name, need in after[dst].items():
            if region_numel(need) == 0:
                continue
            pieces = _pieces(name, need, dst, sources.get(name, {}), sent)
            moves.extend(Move(name, r, src, dst, region_numel(r) * bytes_per_element) for src, r in pieces)
    return Manifest(
        local=tuple(m for m in moves if m.local),
        rounds=_rounds([m for m in moves if not m.local]),
        before=before,
        after=after,
    )


def _pieces(
    name: str, need: Region, dst: int, sources: dict[int, Region], sent: dict[int, int]
) -> list[tuple[int, Region]]:
    """Cut ``need`` along the boundaries of the sources that overlap it and pick a source per piece."""
    if dst in sources and contains(sources[dst], need):
        return [(dst, need)]
    overlapping = [(d, region) for d, region in sources.items() if intersect(region, need)]
    cuts = [{lo, hi} for lo, hi in need]
    for _, region in overlapping:
        for d, ((lo, hi), (s0, s1)) in enumerate(zip(need, region, strict=True)):
            cuts[d].update(x for x in (s0, s1) if lo < x < hi)
    axes = [list(itertools.pairwise(sorted(c))) for c in cuts]
    pieces: list[tuple[int, Region]] = []
    for cell in itertools.product(*axes):
        holders = [d for d, region in overlapping if contains(region, cell)]
        if not holders:
            raise LostStateError(f"no survivor holds {name}{list(cell)}: restore it from a checkpoint")
        if dst in holders:
            src = dst
        else:
            src = min(holders, key=lambda d: (sent[d], d))
            sent[src] += region_numel(cell)
        merged = _merge(pieces[-1][1], cell) if pieces and pieces[-1][0] == src else None
        if merged is None:
            pieces.append((src, cell))
        else:
            pieces[-1] = (src, merged)
    return pieces


def _merge(a: Region, b: Region) -> Region | None:
    """``a`` and ``b`` as one box when ``b`` continues ``a`` along a single dimension."""
    diff = [d for d, (ra, rb) in enumerate(zip(a, b)) if ra != rb]
    if len(diff) != 1 or a[diff[0]][1] != b[diff[0]][0]:
        return None
    d = diff[0]
    return a[:d] + ((a[d][0], b[d][1]),) + a[d + 1 :]


def _rounds(moves: list[Move]) -> tuple[tuple[Move, ...], ...]:
    """Colour the (src, dst) links so no device sends or receives on two links in a round."""
    links: dict[tuple[int, int], list[Move]] = {}
    for m in moves:
        links.setdefault((m.src, m.dst), []).append(m)
    order = sorted(links, key=lambda k: (-sum(m.nbytes for m in links[k]), k))
    by_end: dict[tuple[str, int], list[int]] = {}
    for i, (src, dst) in enumerate(order):
        by_end.setdefault(("send", src), []).append(i)
        by_end.setdefault(("recv", dst), []).append(i)
    adjacency = [
        {j for end in (("send", src), ("recv", dst)) for j in by_end[end] if j != i}
        for i, (src, dst) in enumerate(order)
    ]
    colours = dsatur(adjacency)
    n_rounds = max(colours, default=-1) + 1
    return tuple(
        tuple(m for link, c in zip(order, colours) if c == r for m in links[link]) for r in range(n_rounds)
    )
