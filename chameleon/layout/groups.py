"""The process groups a generation's plan needs, from its layout and transfer manifest."""

from __future__ import annotations

from chameleon.layout.geometry import geometry_of, sync_rounds
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import Manifest
from chameleon.layout.schedule import executors
from chameleon.layout.spec import Layout


def plan_groups(plan: Plan, layout: Layout, manifest: Manifest | None = None) -> list[tuple[int, ...]]:
    """Every process group of a generation: gradient-sync buckets, TP stages, and the pairs of devices that
    exchange activations (its step's 1F1B) or state (its manifest)."""
    groups = {g.devices for groups in sync_rounds(geometry_of(plan), layout) for g in groups}
    groups |= {st.devices for pipe in plan.pipelines for st in pipe.stages if st.tp > 1}
    for j, pipe in enumerate(plan.pipelines):
        for s in range(1, pipe.n_stages):
            for i in range(pipe.micro_batches):
                senders, receivers = executors(plan, j, s - 1, i), executors(plan, j, s, i)
                groups |= {tuple(sorted((a, b))) for a, b in zip(senders, receivers) if a != b}
    if manifest is not None:
        groups |= {tuple(sorted((m.src, m.dst))) for moves in manifest.rounds for m in moves}
    return sorted(groups)
