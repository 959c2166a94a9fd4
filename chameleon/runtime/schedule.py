"""1F1B pipeline schedules as explicit action lists, and the executor that runs one step.

:func:`one_f_one_b` gives one stage's order (warm-up forwards, alternating
forward/backward, cool-down backwards). :func:`step_actions` gives every device's
list for a whole plan — pipelines of different lengths and micro-batch counts, and
rerouted stages whose micro-batches run on same-stage peers of other pipelines.

A device may then serve several pipelines (its own and, as a reroute host, a
peer's). Its list merges one queue per pipeline, each in that pipeline's 1F1B
order, by simulating the step: every device's merged order is then a sub-order
of one global topological order of the step's dependency graph, so with
non-blocking sends no device can wait on another in a cycle. Messages carry a tag
per (pipeline, sending stage, direction), so a pair of devices exchanging several
kinds of traffic can never mismatch them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from chameleon.data.stream import SampleStream, micro_batch_samples
from chameleon.layout.colouring import SyncGroup
from chameleon.layout.plan import Plan, micro_batch_ranges
from chameleon.layout.spec import Region
from chameleon.model.config import ModelConfig
from chameleon.model.llama import TensorParallelOps, stage_forward
from chameleon.runtime.comm import Generation
from chameleon.runtime.stage import StageState

SyncRounds = tuple[tuple[SyncGroup, ...], ...]
MAX_STAGES = 1 << 12
FORWARD_COST, BACKWARD_COST = 1, 2  # relative durations used to merge queues


@dataclass(frozen=True)
class Action:
    """Forward (``"F"``) or backward (``"B"``) of micro-batch ``micro`` (within its pipeline) on a stage."""

    kind: str
    pipeline: int
    stage: int
    micro: int


def one_f_one_b(*, pipeline: int, stage: int, n_stages: int, n_micro: int) -> list[Action]:
    """1F1B order for one stage: ``n_stages − stage − 1`` warm-up forwards, then F/B pairs, then cool-down."""
    warmup = min(n_stages - stage - 1, n_micro)
    actions = [Action("F", pipeline, stage, i) for i in range(warmup)]
    for i in range(n_micro - warmup):
        actions.append(Action("F", pipeline, stage, warmup + i))
        actions.append(Action("B", pipeline, stage, i))
    actions.extend(Action("B", pipeline, stage, i) for i in range(n_micro - warmup, n_micro))
    return actions


def executors(plan: Plan, pipeline: int, stage: int, micro: int) -> tuple[int, ...]:
    """The devices (TP mesh) that run micro-batch ``micro`` of ``pipeline`` at ``stage``."""
    devices = plan.pipelines[pipeline].stages[stage].devices
    if devices:
        return devices
    reroute = next(r for r in plan.reroutes if (r.pipeline, r.stage) == (pipeline, stage))
    return plan.pipelines[reroute.hosts[micro % len(reroute.hosts)]].stages[stage].devices


def _dependency(plan: Plan, action: Action) -> Action | None:
    n_stages = plan.pipelines[action.pipeline].n_stages
    if action.kind == "F":
        return Action("F", action.pipeline, action.stage - 1, action.micro) if action.stage > 0 else None
    if action.stage == n_stages - 1:
        return Action("F", action.pipeline, action.stage, action.micro)
    return Action("B", action.pipeline, action.stage + 1, action.micro)


def step_actions(plan: Plan) -> dict[int, list[Action]]:
    """Every device's action list for one step of ``plan`` (TP ranks of a stage share a list)."""
    queues: dict[tuple[int, ...], dict[int, list[Action]]] = {}
    for j, pipe in enumerate(plan.pipelines):
        for s in range(pipe.n_stages):
            for action in one_f_one_b(pipeline=j, stage=s, n_stages=pipe.n_stages, n_micro=pipe.micro_batches):
                mesh = executors(plan, j, s, action.micro)
                queues.setdefault(mesh, {}).setdefault(j, []).append(action)
    finished: dict[Action, float] = {}
    clock = dict.fromkeys(queues, 0.0)
    order: dict[tuple[int, ...], list[Action]] = {mesh: [] for mesh in queues}
    remaining = sum(len(q) for per in queues.values() for q in per.values())
    while remaining:
        progressed = False
        for mesh, per_pipeline in queues.items():
            ready = []
            for j, queue in sorted(per_pipeline.items(), key=lambda kv: (mesh not in _own(plan, kv[0]), kv[0])):
                if queue:
                    dep = _dependency(plan, queue[0])
                    if dep is None or dep in finished:
                        ready.append((max(clock[mesh], finished.get(dep, 0.0)), len(ready), j))
            if not ready:
                continue
            start, _, j = min(ready)
            action = per_pipeline[j].pop(0)
            clock[mesh] = finished[action] = start + (FORWARD_COST if action.kind == "F" else BACKWARD_COST)
            order[mesh].append(action)
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("the step's schedule has a dependency cycle; the plan is invalid")
    return {device: actions for mesh, actions in order.items() for device in mesh}


def _own(plan: Plan, pipeline: int) -> set[tuple[int, ...]]:
    return {stage.devices for stage in plan.pipelines[pipeline].stages}


def message_tag(pipeline: int, sender_stage: int, backward: bool) -> int:
    """The tag of activations (forward) or gradients (backward) a stage of a pipeline sends."""
    return (pipeline * MAX_STAGES + sender_stage) * 2 + int(backward)


@dataclass
class StepResult:
    """What one device contributes to a step: summed loss, the samples it trained (last stages), the grad norm."""

    loss_sum: float = 0.0
    sample_ids: list[int] = field(default_factory=list)
    grad_norm: float | None = None  # the whole plan's, when train.clip_norm > 0


def run_step(
    step: int,
    *,
    plan: Plan,
    actions: list[Action],
    state: StageState,
    stream: SampleStream,
    gen: Generation,
    model: ModelConfig,
    train: dict,
    rounds: SyncRounds,
    tp: TensorParallelOps | None,
    norm_regions: Mapping[str, Region] | None = None,
    on_phase: Callable[..., None] | None = None,
) -> StepResult:
    """Forward and backward of this device's actions, the gradient sync, the global norm (no optimizer step).

    The loss of every micro-batch is its summed token cross-entropy divided by
    ``global_batch · seq_len``, so gradients summed over pipelines equal the
    single-process gradient of the mean loss. With ``train.clip_norm > 0`` the
    global gradient norm follows the sync (:func:`global_grad_norm` over
    ``norm_regions``, this device's part of ``checkpoint.writers``).
    ``on_phase(phase, step=, detail=)`` is called as each forward/backward (detail:
    the micro-batch) and each sync round starts: the worker's beacon and its fault
    injection hook in there.
    """
    me = gen.me
    first_micro = [r.start for r in micro_batch_ranges(plan)]
    scale = 1.0 / (train["global_batch"] * train["seq_len"])
    hidden_shape = (plan.micro_batch_size, train["seq_len"], model.dim)
    hidden = {"device": state.device, "dtype": state.compute_dtype}
    result = StepResult()
    saved: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    sends = []
    for action in actions:
        p, s, i = action.pipeline, action.stage, action.micro
        pipe = plan.pipelines[p]
        first, last = s == 0, s == pipe.n_stages - 1
        t = executors(plan, p, s, i).index(me)
        if action.kind == "F":
            if on_phase is not None:
                on_phase("forward", step=step, detail=i)
            ids = micro_batch_samples(
                step, first_micro[p] + i, global_batch=train["global_batch"], micro_batch_size=plan.micro_batch_size
            )
            if first or last:
                tokens, targets = (x.to(state.device) for x in stream.batch(ids))
            if first:
                x = tokens
            else:
                x = torch.empty(hidden_shape, **hidden)
                src = executors(plan, p, s - 1, i)[t]
                gen.wait(gen.recv(x, src, tag=message_tag(p, s - 1, False)), peer=src)
                x.requires_grad_(True)
            out = stage_forward(
                state.params, model, x, layers=pipe.stages[s].layers, first=first, last=last, targets=targets if last else None, tp=tp,
            )
            if last:
                out = out * scale
                if t == 0:
                    result.loss_sum += out.item()
                    result.sample_ids.extend(ids)
            else:
                sends.append(gen.send(out.detach().contiguous(), executors(plan, p, s + 1, i)[t], tag=message_tag(p, s, False)))
            saved[(p, s, i)] = (x, out)
        else:
            if on_phase is not None:
                on_phase("backward", step=step, detail=i)
            x, out = saved.pop((p, s, i))
            if last:
                out.backward()
            else:
                grad = torch.empty(hidden_shape, **hidden)
                src = executors(plan, p, s + 1, i)[t]
                gen.wait(gen.recv(grad, src, tag=message_tag(p, s + 1, True)), peer=src)
                out.backward(grad)
            if not first:
                sends.append(gen.send(x.grad.contiguous(), executors(plan, p, s - 1, i)[t], tag=message_tag(p, s, True)))
    gen.wait(*sends)
    sync_gradients(rounds, state=state, gen=gen, on_round=None if on_phase is None else partial(on_phase, "sync", step=step))
    if train["clip_norm"] > 0:
        result.grad_norm = global_grad_norm(state, norm_regions or {}, gen=gen, members=tuple(sorted(plan.devices)))
    return result


def sync_gradients(
    rounds: SyncRounds, *, state: StageState, gen: Generation, on_round: Callable[..., None] | None = None
) -> None:
    """Sum every gradient over the devices holding the same shard, round by coloured round.

    Every device walks the same rounds in the same order; within a round the
    groups are device-disjoint, so this device is in at most one and reduces one bucket.
    ``on_round(detail=r)`` is called as round ``r`` starts (before the first, even with no rounds).
    """
    if on_round is not None and not rounds:
        on_round(detail=-1)
    for r, groups in enumerate(rounds):
        if on_round is not None:
            on_round(detail=r)
        for sync in groups:
            if gen.me not in sync.devices:
                continue
            grads = state.grads(sync.names)
            flat = torch.cat([g.reshape(-1) for g in grads])
            gen.all_reduce(flat, sync.devices)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()


def global_grad_norm(state: StageState, regions: Mapping[str, Region], *, gen: Generation, members: tuple[int, ...]) -> float:
    """The L2 norm of the whole plan's gradient, after the sync, the same on every device of ``members``.

    ``regions`` are the pieces of the gradient this device counts: over all devices
    of the plan they tile every tensor exactly once (``checkpoint.writers`` of the
    plan's layout), whatever the pipelines, TP degrees and reroutes; replicas hold
    equal gradients after the sync, so each piece is counted from one of them. One
    scalar all-reduce over the plan's devices sums the squares.
    """
    total = state.grad_sum_of_squares(regions)
    gen.all_reduce(total, members)
    return total.sqrt().item()
