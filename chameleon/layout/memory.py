"""Bytes a plan needs on each device (the paper's Eq. 14): the one memory model of Chameleon.

Config validation (with costs counted from the model's shapes) and the decision
centre (with costs from a profile) both call :func:`plan_memory`; the bytes per
element of the state come from :class:`chameleon.layout.geometry.StateBytes`.

A stage keeps its parameters, their gradients and optimizer state, plus the
activations of the micro-batches in flight under 1F1B: ``min(n_stages − s, m)``
on stage ``s`` of a pipeline with ``m`` micro-batches, more on a reroute host,
which also keeps those of every pipeline it serves. Under activation recomputation
a layer keeps less, and its backward rebuilds the rest for one layer at a time; each stage is counted under its
own (:attr:`~chameleon.layout.plan.Stage.recompute`). What one device of a stage
holds is the geometry's (:func:`chameleon.layout.geometry.per_device`): a shard of
each transformer layer, the embedding and the head whole.

Beside the tensors a step keeps, the peak counts what it makes for a while: the loss's
working set on the last stage, the gradient copy a synced stage's buckets hold through its
last backward, and the optimizer's denominator. Beside the peak, a device holds
:class:`DeviceOverheads`: the runtime's context, each communicator's buffers and the
allocator's reserve.

A re-layout has its own peak (:func:`relayout_memory`): a device reads its old state until the whole manifest is
done, so it holds that, the new shards it fills and one round's packed buffers at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from chameleon.layout.geometry import MIGRATE_BYTES, UnitParams, per_device
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import Manifest
from chameleon.layout.spec import Region, region_numel
from chameleon.optim import GROUP_ELEMS

GRAD_BYTES = 4  # fp32 gradients: what a sync bucket copies per parameter, and the optimizer's denominator per element


class LayerActivations(NamedTuple):
    """Bytes one layer (whole) keeps per micro-batch until its backward under ``recompute``, and those its backward
    rebuilds at once (one micro-batch)."""

    recompute: str
    kept: float
    rebuilt: float


@dataclass(frozen=True)
class DeviceOverheads:
    """Bytes a device holds besides its plan's tensors: the runtime's ``context`` (an accelerator's context and its
    libraries' workspaces), each communicator's buffers (``per_communicator``), and the allocator's ``reserve``: a
    fraction of the peak it holds without handing it out (``cluster.context_gb``, ``communicator_gb``,
    ``allocator_reserve``)."""

    context: float = 0.0
    per_communicator: float = 0.0
    reserve: float = 0.0


@dataclass(frozen=True)
class MemoryCosts:
    """What the parts of a stage cost in memory, whole (before TP sharding).

    ``params`` are element counts of one transformer layer, the embedding (first
    stage) and the head (last stage); ``acts`` the bytes of activations each keeps
    per micro-batch until its backward; ``state_bytes_per_param`` what a device keeps
    per parameter it holds (:attr:`~chameleon.layout.geometry.StateBytes.resident`,
    plus any redundant copy a simulated baseline keeps); ``layer_rebuilt`` the bytes a
    layer's backward rebuilds at once under recomputation (one micro-batch, one layer);
    ``layers_under`` a layer's activations under each recomputation a stage may have (:meth:`under`); ``head_work``
    the bytes the loss makes for a while on the last stage (its fp32 working copy of the logits and their gradient);
    ``overheads`` what the device holds besides.
    """

    params: UnitParams
    acts: UnitParams
    state_bytes_per_param: float
    layer_rebuilt: float = 0.0
    layers_under: tuple[LayerActivations, ...] = ()
    head_work: float = 0.0
    overheads: DeviceOverheads = DeviceOverheads()

    def under(self, recompute: str) -> MemoryCosts:
        """These costs with a layer's activations under ``recompute`` (as they are where ``layers_under`` lists none)."""
        layer = next((a for a in self.layers_under if a.recompute == recompute), None)
        return self if layer is None else replace(self, acts=self.acts._replace(layer=layer.kept),
                                                  layer_rebuilt=layer.rebuilt)


def stage_memory(costs: MemoryCosts, n_layers: int, *, first: bool, last: bool, in_flight: int, synced: bool,
                 tp: int = 1) -> float:
    """Bytes one device of a ``tp``-wide stage needs at its peak with ``in_flight`` micro-batches of activations
    (``synced``: its gradients are summed with peers'), its device's overheads included.

    The peak is the state plus the largest of three moments: every micro-batch in flight with a backward's
    working set; the last backward with the gradient copy its sync buckets hold (until the step ends); the
    optimizer's update with its denominator (one group of at most :data:`~chameleon.optim.GROUP_ELEMS`).
    """
    params = per_device(costs.params, n_layers, first=first, last=last, tp=tp)
    acts = per_device(costs.acts, n_layers, first=first, last=last, tp=tp)
    working = (costs.layer_rebuilt / tp if n_layers else 0.0) + (costs.head_work if last else 0.0)
    peak = params * costs.state_bytes_per_param + max(
        in_flight * acts + working,
        acts + working + params * GRAD_BYTES if synced else 0.0,
        min(params, GROUP_ELEMS) * GRAD_BYTES,
    )
    return _with_overheads(costs.overheads, peak, _groups(synced=synced, first=first, last=last, tp=tp))


def _groups(*, synced: bool, first: bool, last: bool, tp: int) -> int:
    """The groups a device of a stage is in: its DP sync, a pair with each neighbouring stage, its TP group."""
    return synced + (not first) + (not last) + (tp > 1)


def _with_overheads(over: DeviceOverheads, peak: float, communicators: int) -> float:
    """``peak`` bytes of tensors with the allocator's reserve on them, the context and ``communicators``' buffers."""
    return peak * (1 + over.reserve) + over.context + communicators * over.per_communicator


def plan_memory(costs: MemoryCosts, plan: Plan) -> dict[int, float]:
    """Bytes every device of ``plan`` needs (Eq. 14), each stage under its own recomputation; a reroute host keeps
    activations for each pipeline it serves (under its own recomputation). A plan of more than one pipeline syncs
    every stage's gradients."""
    served: dict[tuple[int, int], int] = {}
    for r in plan.reroutes:
        for h in set(r.hosts):
            served[(h, r.stage)] = served.get((h, r.stage), 0) + 1
    under = {mode: costs.under(mode) for mode in {st.recompute for p in plan.pipelines for st in p.stages}}
    need = {}
    for j, p in enumerate(plan.pipelines):
        for s, st in enumerate(p.stages):
            in_flight = min(p.n_stages - s, p.micro_batches) * (1 + served.get((j, s), 0))
            mem = stage_memory(
                under[st.recompute], st.n_layers, first=s == 0, last=s == p.n_stages - 1, in_flight=in_flight,
                tp=max(st.tp, 1), synced=len(plan.pipelines) > 1,
            )
            for d in st.devices:
                need[d] = mem
    return need


def communicators(plan: Plan) -> dict[int, int]:
    """The groups each device of ``plan`` is in (:func:`_groups`; a plan of several pipelines syncs every stage)."""
    synced = len(plan.pipelines) > 1
    return {d: _groups(synced=synced, first=s == 0, last=s == p.n_stages - 1, tp=max(st.tp, 1))
            for p in plan.pipelines for s, st in enumerate(p.stages) for d in st.devices}


def relayout_memory(costs: MemoryCosts, manifest: Manifest, old: Plan, new: Plan,
                    moved_bytes: int = MIGRATE_BYTES) -> dict[int, float]:
    """Bytes each device that sends, receives or changes in ``manifest`` (``old`` → ``new``) needs at a re-layout's
    peak, as :func:`~chameleon.runtime.worker.transfer.execute_manifest` runs it (``moved_bytes`` per element: the
    weight and the moments a move carries).

    The old state is read until the manifest is done (:attr:`MemoryCosts.state_bytes_per_param` per element it held,
    its gradient counted); a device that changes fills new shards beside it; each round it packs what it sends on
    its one outgoing link and receives what comes on its one incoming link. Its groups of both generations hold their
    buffers (a broken one's until every survivor has left it). Kept devices that send nothing need nothing more than
    before, and are left out.
    """
    numel: dict[int, int] = {}  # by the id of a dict of regions, which devices of a stage share

    def held(regions: dict[str, Region]) -> int:
        if id(regions) not in numel:
            numel[id(regions)] = sum(region_numel(r) for r in regions.values())
        return numel[id(regions)]

    buffers: dict[int, int] = {}
    for moves in manifest.rounds:
        links: dict[int, int] = {}  # each device's bytes this round: at most one link out and one in
        for m in moves:
            links[m.src] = links.get(m.src, 0) + m.nbytes
            links[m.dst] = links.get(m.dst, 0) + m.nbytes
        for d, n in links.items():
            buffers[d] = max(buffers.get(d, 0), n)
    before, after = communicators(old), communicators(new)
    out = {}
    for d in manifest.before.keys() | manifest.after.keys():
        state = held(manifest.before.get(d, {})) * costs.state_bytes_per_param
        fresh = 0 if d in manifest.kept else held(manifest.after.get(d, {})) * moved_bytes
        out[d] = _with_overheads(costs.overheads, state + fresh + buffers.get(d, 0), before.get(d, 0) + after.get(d, 0))
    return out
