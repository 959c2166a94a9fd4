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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from chameleon.layout.geometry import UnitParams, per_device
from chameleon.layout.plan import Plan
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
    over = costs.overheads
    communicators = synced + (not first) + (not last) + (tp > 1)
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
