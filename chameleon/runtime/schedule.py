"""1F1B pipeline schedules as explicit action lists, and the executor that runs one step.

:func:`one_f_one_b` gives a stage's actions (warm-up forwards, alternating
forward/backward, cool-down backwards). :func:`step_actions` gives every device's
list for a whole plan — pipelines of different lengths and micro-batch counts in
one step — so tests can inspect the schedule; :func:`run_step` executes one
device's list with asynchronous point-to-point transfers polled against faults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from chameleon.data.stream import SampleStream, micro_batch_samples
from chameleon.layout.colouring import SyncGroup
from chameleon.layout.plan import Plan, micro_batch_ranges
from chameleon.model.config import ModelConfig
from chameleon.model.llama import TensorParallelOps, stage_forward
from chameleon.runtime.comm import Generation
from chameleon.runtime.stage import Role, StageState


SyncRounds = tuple[tuple[SyncGroup, ...], ...]


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


def step_actions(plan: Plan) -> dict[int, list[Action]]:
    """Every device's action list for one step of ``plan`` (TP ranks of a stage share a list)."""
    out: dict[int, list[Action]] = {}
    for j, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            actions = one_f_one_b(pipeline=j, stage=s, n_stages=pipe.n_stages, n_micro=pipe.micro_batches)
            for device in stage.devices:
                out[device] = actions
    return out


@dataclass
class StepResult:
    """What one device contributes to a step: summed loss and the samples it trained (last stages)."""

    loss_sum: float = 0.0
    sample_ids: list[int] = field(default_factory=list)


def run_step(
    step: int,
    *,
    plan: Plan,
    role: Role,
    state: StageState,
    stream: SampleStream,
    gen: Generation,
    model: ModelConfig,
    train: dict,
    rounds: SyncRounds,
    tp: TensorParallelOps | None,
) -> StepResult:
    """Forward and backward of this device's micro-batches in 1F1B order, then the gradient sync.

    The loss of every micro-batch is its summed token cross-entropy divided by
    ``global_batch · seq_len``, so gradients summed over pipelines equal the
    single-process gradient of the mean loss.
    """
    first_micro = micro_batch_ranges(plan)[role.pipeline].start
    scale = 1.0 / (train["global_batch"] * train["seq_len"])
    hidden_shape = (plan.micro_batch_size, train["seq_len"], model.dim)
    prev_rank = role.prev_devices[role.tp_index] if role.prev_devices else None
    next_rank = role.next_devices[role.tp_index] if role.next_devices else None
    result = StepResult()
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    sends: list[dist.Work] = []
    for action in step_actions(plan)[role.device]:
        ids = micro_batch_samples(
            step, first_micro + action.micro, global_batch=train["global_batch"], micro_batch_size=plan.micro_batch_size
        )
        if action.kind == "F":
            tokens, targets = (t.to(state.device) for t in stream.batch(ids))
            if role.first:
                x = tokens
            else:
                x = torch.empty(hidden_shape, device=state.device)
                gen.wait(dist.irecv(x, src=prev_rank))
                x.requires_grad_(True)
            out = stage_forward(
                state.params, model, x, layers=role.spec.layers, first=role.first, last=role.last,
                targets=targets if role.last else None, tp=tp,
            )
            if role.last:
                out = out * scale
                if role.tp_index == 0:
                    result.loss_sum += out.item()
                    result.sample_ids.extend(ids)
            else:
                sends.append(dist.isend(out.detach().contiguous(), dst=next_rank))
            inputs[action.micro], outputs[action.micro] = x, out
        else:
            x, out = inputs.pop(action.micro), outputs.pop(action.micro)
            if role.last:
                out.backward()
            else:
                grad = torch.empty(hidden_shape, device=state.device)
                gen.wait(dist.irecv(grad, src=next_rank))
                out.backward(grad)
            if not role.first:
                sends.append(dist.isend(x.grad.contiguous(), dst=prev_rank))
    gen.wait(*sends)
    sync_gradients(rounds, role=role, state=state, gen=gen)
    return result


def sync_gradients(rounds: SyncRounds, *, role: Role, state: StageState, gen: Generation) -> None:
    """Sum every gradient over the devices holding the same shard, round by coloured round.

    Every rank walks the same rounds in the same order; within a round the groups
    are device-disjoint, so this device is in at most one and reduces one bucket.
    """
    for groups in rounds:
        for sync in groups:
            group = gen.group(sync.devices)
            if group is None:
                continue
            grads = state.grads(sync.names)
            flat = torch.cat([g.reshape(-1) for g in grads])
            gen.all_reduce(flat, group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
