"""Bytes a plan needs on each device (the paper's Eq. 14): the one memory model of Chameleon.

Config validation (with costs counted from the model's shapes) and the decision
centre (with costs from a profile) both call :func:`plan_memory`, and every byte
count per element comes from the constants here.

A stage keeps its parameters, their gradients and optimizer state, plus the
activations of the micro-batches in flight under 1F1B: ``min(n_stages − s, m)``
on stage ``s`` of a pipeline with ``m`` micro-batches, more on a reroute host,
which also keeps those of every pipeline it serves. Transformer layers are
sharded over a stage's TP group; the embedding and the head are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon.layout.plan import Plan

ELEMENT_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per element of each compute dtype (``train.dtype``)."""
MOMENT_BYTES = 2 * ELEMENT_BYTES["fp32"]
"""Bytes per parameter of AdamW's two fp32 moments."""
MIGRATE_BYTES = ELEMENT_BYTES["fp32"] + MOMENT_BYTES
"""Bytes per parameter a device fetches to take one over: its fp32 weight and two moments."""


def state_bytes_per_param(dtype: str) -> int:
    """Resident bytes per parameter: fp32 weight, fp32 gradient, two moments, plus a compute copy in ``dtype``."""
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"train.dtype={dtype!r}: use one of {sorted(ELEMENT_BYTES)}")
    copy = 0 if dtype == "fp32" else ELEMENT_BYTES[dtype]
    return 2 * ELEMENT_BYTES["fp32"] + MOMENT_BYTES + copy


@dataclass(frozen=True)
class MemoryCosts:
    """What the parts of a stage cost in memory, whole (before TP sharding).

    ``*_params`` are element counts of one transformer layer, the embedding
    (first stage) and the head (last stage); ``*_act_bytes`` are the bytes of
    activations each keeps per micro-batch until its backward.
    """

    layer_params: float
    first_params: float
    last_params: float
    layer_act_bytes: float
    first_act_bytes: float
    last_act_bytes: float
    state_bytes_per_param: float


def stage_memory(costs: MemoryCosts, n_layers: int, *, first: bool, last: bool, in_flight: int, tp: int = 1) -> float:
    """Bytes one device of a ``tp``-wide stage needs with ``in_flight`` micro-batches of activations."""
    params = n_layers * costs.layer_params / tp + first * costs.first_params + last * costs.last_params
    acts = n_layers * costs.layer_act_bytes / tp + first * costs.first_act_bytes + last * costs.last_act_bytes
    return params * costs.state_bytes_per_param + in_flight * acts


def plan_memory(costs: MemoryCosts, plan: Plan) -> dict[int, float]:
    """Bytes every device of ``plan`` needs (Eq. 14); a reroute host keeps activations for each pipeline it serves."""
    served: dict[tuple[int, int], int] = {}
    for r in plan.reroutes:
        for h in set(r.hosts):
            served[(h, r.stage)] = served.get((h, r.stage), 0) + 1
    need = {}
    for j, p in enumerate(plan.pipelines):
        for s, st in enumerate(p.stages):
            in_flight = min(p.n_stages - s, p.micro_batches) * (1 + served.get((j, s), 0))
            mem = stage_memory(
                costs, st.n_layers, first=s == 0, last=s == p.n_stages - 1, in_flight=in_flight, tp=max(st.tp, 1)
            )
            for d in st.devices:
                need[d] = mem
    return need
