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
  (links are full duplex; a greedy edge colouring of the senders × receivers
  graph, heaviest link first); everything between two devices goes in one round.

Nothing here touches a process group; :mod:`chameleon.runtime.worker.transfer` executes
a manifest.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

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
        before: the regions held before the move by each survivor that sends or changes.
        after: the regions in the new layout of each device that changes.
        kept: devices whose regions are the same in both layouts: they keep their state as it
            is (most of a large job after one fault), and may send from it.
    """

    local: tuple[Move, ...]
    rounds: tuple[tuple[Move, ...], ...]
    before: dict[int, dict[str, Region]]
    after: dict[int, dict[str, Region]]
    kept: frozenset[int] = frozenset()

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
    held = {d: old[d] for d in alive if d in old}
    new = device_holdings(new_layout)
    strangers = sorted(set(new) - set(alive))
    if strangers:
        raise ValueError(f"the new layout uses devices {strangers}, which are not survivors")
    kept = frozenset(d for d, regions in new.items() if held.get(d) == regions)
    after = {d: regions for d, regions in new.items() if d not in kept}
    sources = _Sources(held)
    moves: list[Move] = []
    for dst in sorted(after):
        for name, need in after[dst].items():
            if region_numel(need) == 0:
                continue
            pieces = _pieces(name, need, held.get(dst, {}).get(name), sources)
            moves.extend(Move(name, r, dst if src is None else src, dst, region_numel(r) * bytes_per_element)
                         for src, r in pieces)
    senders = {m.src for m in moves}
    return Manifest(
        local=tuple(m for m in moves if m.local),
        rounds=_rounds([m for m in moves if not m.local]),
        before={d: regions for d, regions in held.items() if d in senders or d in after},
        after=after,
        kept=kept,
    )


class _Sources:
    """Who holds each region of each tensor, and how much each holder has sent so far.

    Replicas hold equal regions, so holders are grouped by region; each group keeps a heap of
    its devices by bytes sent (lazily refreshed), so the least-loaded holder of a piece is found
    in time logarithmic in the replicas, not linear.
    """

    def __init__(self, held: Mapping[int, Mapping[str, Region]]):
        self.regions: dict[str, dict[Region, list[int]]] = {}
        for device in sorted(held):
            for name, region in held[device].items():
                self.regions.setdefault(name, {}).setdefault(region, []).append(device)
        self.sent: dict[int, int] = dict.fromkeys(held, 0)
        self._heaps: dict[tuple[str, Region], list[tuple[int, int]]] = {}

    def least_loaded(self, name: str, regions: list[Region]) -> int:
        """The holder of one of ``regions`` of ``name`` that has sent least (then the lowest id)."""
        best = None
        for region in regions:
            heap = self._heaps.get((name, region))
            if heap is None:
                heap = self._heaps[name, region] = [(self.sent[d], d) for d in self.regions[name][region]]
                heapq.heapify(heap)
            while heap[0][0] != self.sent[heap[0][1]]:
                _, d = heapq.heappop(heap)
                heapq.heappush(heap, (self.sent[d], d))
            best = heap[0] if best is None else min(best, heap[0])
        return best[1]


def _pieces(name: str, need: Region, own: Region | None, sources: _Sources) -> list[tuple[int | None, Region]]:
    """Cut ``need`` along the boundaries of the held regions that overlap it and pick a source per piece
    (None: the receiver itself, which holds it already)."""
    if own is not None and contains(own, need):
        return [(None, need)]
    held = sources.regions.get(name, {})
    if need in held and own is None:  # a replica holds exactly this region (the common case): one piece
        src = sources.least_loaded(name, [need])
        sources.sent[src] += region_numel(need)
        return [(src, need)]
    overlapping = [region for region in held if intersect(region, need)]
    cuts = [{lo, hi} for lo, hi in need]
    for region in overlapping:
        for d, ((lo, hi), (s0, s1)) in enumerate(zip(need, region, strict=True)):
            cuts[d].update(x for x in (s0, s1) if lo < x < hi)
    axes = [list(itertools.pairwise(sorted(c))) for c in cuts]
    pieces: list[tuple[int | None, Region]] = []
    for cell in itertools.product(*axes):
        if own is not None and contains(own, cell):
            src = None
        else:
            regions = [region for region in overlapping if contains(region, cell)]
            if not regions:
                raise LostStateError(f"no survivor holds {name}{list(cell)}: restore it from a checkpoint")
            src = sources.least_loaded(name, regions)
            sources.sent[src] += region_numel(cell)
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
    """Colour the (src, dst) links so no device sends or receives on two links in a round.

    The links form a bipartite graph (senders, receivers); each link, heaviest first,
    takes the first round in which neither its sender sends nor its receiver receives
    yet. That needs at most ``2Δ − 1`` rounds for ``Δ`` links at the busiest end, in time
    linear in the links (a general graph colouring of their conflicts is quadratic).
    """
    links: dict[tuple[int, int], list[Move]] = {}
    for m in moves:
        links.setdefault((m.src, m.dst), []).append(m)
    order = sorted(links, key=lambda k: (-sum(m.nbytes for m in links[k]), k))
    sending: dict[int, set[int]] = {}
    receiving: dict[int, set[int]] = {}
    rounds: list[list[Move]] = []
    for src, dst in order:
        busy_s, busy_r = sending.setdefault(src, set()), receiving.setdefault(dst, set())
        r = next(r for r in range(len(rounds) + 1) if r not in busy_s and r not in busy_r)
        if r == len(rounds):
            rounds.append([])
        busy_s.add(r)
        busy_r.add(r)
        rounds[r].extend(links[src, dst])
    return tuple(tuple(r) for r in rounds)


def manifest_parts(manifest: Manifest, node_of: Callable[[int], int]) -> dict[int, Manifest]:
    """Each node's part of ``manifest``, in one pass: the moves its devices take part in (every round kept, so
    rounds keep their indices, empty where they have none), their regions before and after, those it keeps."""
    local: dict[int, list[Move]] = {}
    rounds: dict[int, list[list[Move]]] = {}
    for m in manifest.local:
        local.setdefault(node_of(m.dst), []).append(m)
    for r, moves in enumerate(manifest.rounds):
        for m in moves:
            for node in {node_of(m.src), node_of(m.dst)}:
                rounds.setdefault(node, [[] for _ in manifest.rounds])[r].append(m)
    before: dict[int, dict] = {}
    after: dict[int, dict] = {}
    for held, out in ((manifest.before, before), (manifest.after, after)):
        for d, regions in held.items():
            out.setdefault(node_of(d), {})[d] = regions
    kept: dict[int, set[int]] = {}
    for d in manifest.kept:
        kept.setdefault(node_of(d), set()).add(d)
    nodes = set(local) | set(rounds) | set(before) | set(after) | set(kept)
    empty = tuple(() for _ in manifest.rounds)
    return {n: Manifest(tuple(local.get(n, ())), tuple(map(tuple, rounds[n])) if n in rounds else empty,
                        before.get(n, {}), after.get(n, {}), frozenset(kept.get(n, ()))) for n in nodes}
