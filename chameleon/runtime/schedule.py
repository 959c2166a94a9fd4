"""The executor that runs one step of a plan's 1F1B action lists (:mod:`chameleon.layout.schedule`).

Messages carry a tag per (pipeline, sending stage, direction), so a pair of
devices exchanging several kinds of traffic can never mismatch them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from chameleon.data.stream import SampleStream, micro_batch_samples
from chameleon.layout.colouring import SyncGroup
from chameleon.layout.plan import Plan, micro_batch_ranges
from chameleon.layout.schedule import Action, executors
from chameleon.layout.spec import Region
from chameleon.config import TrainConfig
from chameleon.model.config import ModelConfig
from chameleon.model.spec import TensorParallelOps, spec_of
from chameleon.runtime.comm import Generation
from chameleon.runtime.stage import StageState

SyncRounds = tuple[tuple[SyncGroup, ...], ...]
MAX_STAGES = 1 << 12


def message_tag(pipeline: int, sender_stage: int, backward: bool) -> int:
    """The tag of activations (forward) or gradients (backward) a stage of a pipeline sends."""
    return (pipeline * MAX_STAGES + sender_stage) * 2 + int(backward)


@dataclass
class StepResult:
    """What one device contributes to a step: summed loss, the samples it trained (last stages), and its part
    of the squared global gradient norm (when clipping)."""

    loss_sum: float = 0.0
    sample_ids: list[int] = field(default_factory=list)
    norm_sq: float | None = None  # Σ‖g‖² over this device's pieces of the plan's gradient, when train.clip_norm > 0


def run_step(
    step: int,
    *,
    plan: Plan,
    actions: list[Action],
    state: StageState,
    stream: SampleStream,
    gen: Generation,
    model: ModelConfig,
    train: TrainConfig,
    rounds: SyncRounds,
    tp: TensorParallelOps | None,
    norm_regions: Mapping[str, Region] | None = None,
    on_phase: Callable[..., None] | None = None,
) -> StepResult:
    """Forward and backward of this device's actions, the gradient sync, its part of the norm (no optimizer step).

    The loss of every micro-batch is its summed token cross-entropy divided by
    ``global_batch · seq_len``, so gradients summed over pipelines equal the
    single-process gradient of the mean loss. With ``train.clip_norm > 0`` the
    sum of squares of this device's pieces of the gradient follows the sync
    (``norm_regions``, its part of :func:`chameleon.layout.geometry.writers`: over the plan they tile
    every tensor once, whatever the pipelines, TP degrees and reroutes); the
    controller adds the parts up, so the global norm costs no collective.
    ``on_phase(phase, step=, detail=)`` is called as each forward/backward (detail:
    the micro-batch) and each sync round starts: the worker's beacon and its fault
    injection hook in there.
    """
    me = gen.me
    first_micro = [r.start for r in micro_batch_ranges(plan)]
    scale = 1.0 / (train.global_batch * train.seq_len)
    hidden_shape = (plan.micro_batch_size, train.seq_len, model.dim)
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
                step, first_micro[p] + i, global_batch=train.global_batch, micro_batch_size=plan.micro_batch_size
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
            out = spec_of(model).stage_forward(
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
    if train.clip_norm > 0:
        result.norm_sq = state.grad_sum_of_squares(norm_regions or {}).item()
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
