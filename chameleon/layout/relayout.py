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


_NOTHING: Mapping[str, Region] = {}  # what a device that held nothing holds (read only)


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
    return relayout_held(device_holdings(old_layout), device_holdings(new_layout), survivors=survivors,
                         bytes_per_element=bytes_per_element)


def relayout_held(
    old: Mapping[int, Mapping[str, Region]],
    new: Mapping[int, Mapping[str, Region]],
    *,
    survivors: Iterable[int],
    bytes_per_element: int = MIGRATE_BYTES,
) -> Manifest:
    """:func:`relayout` from each device's regions before and after (:func:`~chameleon.layout.spec.device_holdings`).

    Devices that share one dict of regions (:func:`~chameleon.layout.spec.stage_holdings`) are worked out once per
    pair of dicts before and after; only the choice of sources is made per device.
    """
    alive = sorted(set(survivors))
    held = {d: old[d] for d in alive if d in old}
    strangers = sorted(set(new) - set(alive))
    if strangers:
        raise ValueError(f"the new layout uses devices {strangers}, which are not survivors")
    kept = frozenset(d for d, regions in new.items() if held.get(d) == regions)
    after = {d: regions for d, regions in new.items() if d not in kept}
    sources = _Sources(held)
    recipes: dict[tuple[int, int], list[tuple[str, Region, int, str]]] = {}  # by the ids of both dicts
    local: list[Move] = []
    wire: list[Move] = []
    for dst in sorted(after):
        own = held.get(dst, _NOTHING)
        key = (id(own), id(after[dst]))
        if key not in recipes:
            recipes[key] = _recipe(own, after[dst], sources)
        for name, need, numel, how in recipes[key]:
            if how == "own":
                local.append(Move(name, need, dst, dst, numel * bytes_per_element))
            elif how == "replica":
                src = sources.least_loaded(name, [need])
                sources.sent[src] += numel
                wire.append(Move(name, need, src, dst, numel * bytes_per_element))
            else:
                for src, r in _pieces(name, need, own.get(name), sources):
                    (local if src is None else wire).append(
                        Move(name, r, dst if src is None else src, dst, region_numel(r) * bytes_per_element))
    senders = {m.src for m in wire}
    return Manifest(
        local=tuple(local),
        rounds=_rounds(wire),
        before={d: regions for d, regions in held.items() if d in senders or d in after},
        after=after,
        kept=kept,
    )


def _recipe(own: Mapping[str, Region], needs: Mapping[str, Region],
            sources: _Sources) -> list[tuple[str, Region, int, str]]:
    """How a device holding ``own`` gets each non-empty region of ``needs``: ``(name, region, elements, how)``,
    ``how`` ``own`` where it holds the region already, ``replica`` where it holds none of the tensor and a
    replica holds exactly the region (one source), else ``cut`` along the held regions' boundaries
    (:func:`_pieces`)."""
    out = []
    for name, need in needs.items():
        numel = region_numel(need)
        if not numel:
            continue
        mine = own.get(name)
        if mine is not None and contains(mine, need):
            out.append((name, need, numel, "own"))
        elif mine is None and need in sources.regions.get(name, {}):
            out.append((name, need, numel, "replica"))
        else:
            out.append((name, need, numel, "cut"))
    return out


class _Sources:
    """Who holds each region of each tensor, and how much each holder has sent so far.

    Replicas hold equal regions, so holders are grouped by region, and regions held by the same devices share
    one group (a layer's tensors on one TP index); each group keeps a heap of its devices by bytes sent (lazily
    refreshed), so the least-loaded holder of a piece is found in time logarithmic in the replicas, not linear.
    Devices that share one dict of regions are grouped once.
    """

    def __init__(self, held: Mapping[int, Mapping[str, Region]]):
        alike: dict[int, tuple[Mapping[str, Region], list[int]]] = {}  # devices by their (shared) dict
        for device in sorted(held):
            alike.setdefault(id(held[device]), (held[device], []))[1].append(device)
        dicts: dict[tuple[str, Region], list[int]] = {}  # (name, region) → the dicts holding it
        for key, (regions, _) in alike.items():
            for name, region in regions.items():
                dicts.setdefault((name, region), []).append(key)
        groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.regions: dict[str, dict[Region, list[tuple[int, int]]]] = {}
        for (name, region), keys in dicts.items():
            if tuple(keys) not in groups:
                groups[tuple(keys)] = sorted((0, d) for key in keys for d in alike[key][1])
            self.regions.setdefault(name, {})[region] = groups[tuple(keys)]
        self.sent: dict[int, int] = dict.fromkeys(held, 0)

    def least_loaded(self, name: str, regions: list[Region]) -> int:
        """The holder of one of ``regions`` of ``name`` that has sent least (then the lowest id)."""
        best = None
        for region in regions:
            heap = self.regions[name][region]
            while heap[0][0] != self.sent[heap[0][1]]:
                _, d = heapq.heappop(heap)
                heapq.heappush(heap, (self.sent[d], d))
            best = heap[0] if best is None else min(best, heap[0])
        return best[1]


def _pieces(name: str, need: Region, own: Region | None, sources: _Sources) -> list[tuple[int | None, Region]]:
    """Cut ``need`` along the boundaries of the held regions that overlap it and pick a source per piece
    (None: the receiver itself, which holds it already)."""
    held = sources.regions.get(name, {})
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
    load: dict[tuple[int, int], int] = {}
    for m in moves:
        link = (m.src, m.dst)
        if link in links:
            links[link].append(m)
            load[link] += m.nbytes
        else:
            links[link], load[link] = [m], m.nbytes
    order = sorted(links, key=lambda k: (-load[k], k))
    sending: dict[int, int] = {}  # device → the rounds it sends in, as bits
    receiving: dict[int, int] = {}
    rounds: list[list[Move]] = []
    for src, dst in order:
        sends, receives = sending.get(src, 0), receiving.get(dst, 0)
        busy = sends | receives
        r = (~busy & (busy + 1)).bit_length() - 1  # the lowest round neither end is busy in
        if r == len(rounds):
            rounds.append([])
        sending[src], receiving[dst] = sends | 1 << r, receives | 1 << r
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
                if node not in rounds:
                    rounds[node] = [[] for _ in manifest.rounds]
                rounds[node][r].append(m)
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
