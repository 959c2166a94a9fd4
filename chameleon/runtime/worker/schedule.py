"""The executor that runs one step of a plan's 1F1B action lists (:mod:`chameleon.layout.schedule`).

Each action's sends and receives are those :func:`~chameleon.layout.schedule.exchanges`
plans: tagged per (pipeline, sending stage, direction), and a send to the device
received from next posted with that receive as one batch (:class:`_Links`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from chameleon.config import TrainConfig
from chameleon.data.stream import SampleStream, micro_batch_samples
from chameleon.layout.colouring import SyncGroup
from chameleon.layout.plan import Plan, micro_batch_ranges
from chameleon.layout.schedule import Action, Exchange, Link, exchanges, executors
from chameleon.layout.spec import Region, local_slices
from chameleon.model.config import ModelConfig
from chameleon.model.spec import TensorParallelOps, spec_of
from chameleon.runtime.worker.comm import Generation
from chameleon.runtime.worker.device import compute_clock
from chameleon.runtime.worker.stage import StageState

SyncRounds = tuple[tuple[SyncGroup, ...], ...]


@dataclass
class StepResult:
    """What one device contributes to a step: summed loss, the samples it trained (last stages), its part
    of the squared global gradient norm (when clipping), whether its own loss and gradients were finite, and
    the seconds it computed (its forwards and backwards, waits for its peers left out)."""

    loss_sum: float = 0.0
    sample_ids: list[int] = field(default_factory=list)
    norm_sq: float | None = None  # Σ‖g‖² over this device's pieces of the plan's gradient, when train.clip_norm > 0
    finite: bool = True  # before the sync, so a device that computed a non-finite value is the one named
    busy_s: float = 0.0


class _Busy:
    """Times a device's own compute (``with busy:``): a CPU's on its :func:`compute_clock`; an accelerator's by a pair
    of timing events on its stream around each block, read once the step's host read has waited for them (timing
    costs no synchronisation). ``pace(seconds)`` stretches a block (a slow fault; on an accelerator it waits for the
    block's kernels to know their time), and the seconds it took in all are counted."""

    def __init__(self, pace: Callable[[float], float] | None, device: torch.device):
        self.pace, self.clock, self.device = pace, compute_clock(device), device
        self.timed, self.spans = 0.0, []

    def __enter__(self) -> None:
        self.start = self._event() if self.device.type != "cpu" else self.clock()

    def __exit__(self, *exc) -> None:
        paced = self.pace is not None and exc[0] is None
        if self.device.type != "cpu":
            end = self._event()
            if not paced:
                self.spans.append((self.start, end))
                return
            end.synchronize()
            took = self.start.elapsed_time(end) / 1e3
        else:
            took = self.clock() - self.start
        self.timed += self.pace(took) if paced else took

    def _event(self) -> torch.Event:
        event = torch.Event(self.device.type, enable_timing=True)
        event.record()
        return event

    @property
    def seconds(self) -> float:
        """Every block's seconds; on an accelerator, call it once its events have completed (after a host read)."""
        return self.timed + sum(start.elapsed_time(end) for start, end in self.spans) / 1e3


@functools.cache
def _compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` under ``torch.compile``, once per process: its graphs are kept across steps and generations (the rotary
    tables' cache is traced through, as meant: no warning of it)."""
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    return torch.compile(fn)


def stage_forward(model: ModelConfig, *, compiled: bool) -> Callable[..., torch.Tensor]:
    """The model's stage forward (:mod:`chameleon.model.spec`), compiled with ``train.compile``."""
    forward = spec_of(model).stage_forward
    return _compiled(forward) if compiled else forward


class _Links:
    """This device's point-to-point traffic in a step, as the step's exchanges
    (:class:`~chameleon.layout.schedule.Exchange`) plan it: a held send goes with the next receive as one batch
    (:meth:`Generation.post_batch`), every other send at once."""

    def __init__(self, gen: Generation):
        self.gen = gen
        self.held: tuple[torch.Tensor, Link] | None = None
        self.sends: list[dist.Work] = []

    def send(self, tensor: torch.Tensor, exchange: Exchange) -> None:
        """Send ``tensor`` as ``exchange`` says: now, or held for the next receive."""
        if exchange.held:
            self.held = (tensor, exchange.send)
        else:
            self.sends.append(self.gen.send(tensor, exchange.send.peer, tag=exchange.send.tag))

    def receive(self, buffer: torch.Tensor, link: Link) -> None:
        """Receive ``buffer`` over ``link`` (with the send held for that peer, in one batch) and wait for it."""
        held, self.held = self.held, None
        sends, receives = self.gen.post_batch(link.peer, sends=[(held[0], held[1].tag)] if held else [],
                                              receives=[(buffer, link.tag)])
        self.sends += sends  # waited for at the end, as every send
        self.gen.wait(*receives, peer=link.peer)

    def finish(self) -> None:
        """Wait for every send posted (a held send is always followed by its receive)."""
        self.gen.wait(*self.sends)
        self.sends.clear()


class _Forwards:
    """The forward of one action of a step: its inputs (tokens or the previous stage's activations), its output,
    and the send of that output to the next stage (the activations' peer is the executor of the same rank)."""

    def __init__(self, *, plan: Plan, state: StageState, stream: SampleStream, gen: Generation, model: ModelConfig,
                 train: TrainConfig, tp: TensorParallelOps | None, busy: _Busy):
        self.plan, self.state, self.stream, self.gen, self.model, self.train, self.tp = (
            plan, state, stream, gen, model, train, tp)
        self.busy = busy
        self.first_micro = [r.start for r in micro_batch_ranges(plan)]
        self.hidden_shape = (plan.micro_batch_size, train.seq_len, model.dim)
        self.links = _Links(gen)

    def hidden(self) -> torch.Tensor:
        return torch.empty(self.hidden_shape, device=self.state.device, dtype=self.state.compute_dtype)

    def __call__(self, action: Action, exchange: Exchange, batch: int) -> tuple[torch.Tensor, torch.Tensor, range, bool]:
        """``(input, output, sample ids, counts)`` of forward ``action`` of global batch ``batch``, with its traffic
        ``exchange``; the output is the summed token loss on a last stage (``counts``: this device adds it up, the TP
        group's first)."""
        plan, gen, p, s, i = self.plan, self.gen, action.pipeline, action.stage, action.micro
        pipe = plan.pipelines[p]
        first, last = s == 0, s == pipe.n_stages - 1
        t = executors(plan, p, s, i).index(gen.me)
        ids = micro_batch_samples(batch, self.first_micro[p] + i, global_batch=self.train.global_batch,
                                  micro_batch_size=plan.micro_batch_size)
        if first or last:
            tokens, targets = (x.to(self.state.device) for x in self.stream.batch(ids))
        if first:
            x = tokens
        else:
            x = self.hidden()
            self.links.receive(x, exchange.receive)
            x.requires_grad_(torch.is_grad_enabled())
        with self.busy:
            out = stage_forward(self.model, compiled=self.train.compile)(
                self.state.params, self.model, x, layers=pipe.stages[s].layers, first=first, last=last,
                targets=targets if last else None, tp=self.tp, recompute=pipe.stages[s].recompute,
            )
        if not last:
            self.links.send(out.detach().contiguous(), exchange)
        return x, out, ids, last and t == 0


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
    pace: Callable[[float], float] | None = None,
) -> StepResult:
    """Forward and backward of this device's actions, the gradient sync, its part of the norm (no optimizer step).

    The loss of every micro-batch is its summed token cross-entropy divided by
    ``global_batch · seq_len``, so gradients summed over pipelines equal the
    single-process gradient of the mean loss. The sync (:class:`GradientSync`) overlaps
    this device's last backward. With ``train.clip_norm > 0`` the
    sum of squares of this device's pieces of the gradient follows the sync
    (``norm_regions``, its part of :func:`chameleon.layout.geometry.writers`: over the plan they tile
    every tensor once, whatever the pipelines, TP degrees and reroutes); the
    controller adds the parts up, so the global norm costs no collective. Before the
    sync, whether this device's own loss and gradients are finite (``result.finite``):
    the controller commits no step that is not, and names the device that made it so.
    ``on_phase(phase, step=, detail=)`` is called as each forward/backward (detail:
    the micro-batch) and each sync round starts: the worker's beacon and its fault
    injection hook in there; ``pace(seconds)`` after each forward and backward (a slow device's, stretched).
    """
    scale = 1.0 / (train.global_batch * train.seq_len)
    busy = _Busy(pace, state.device)
    forward = _Forwards(plan=plan, state=state, stream=stream, gen=gen, model=model, train=train, tp=tp, busy=busy)
    sync = GradientSync(rounds, state=state, gen=gen, bucket_bytes=train.bucket_mb * 2**20)
    last_backward = max((k for k, a in enumerate(actions) if a.kind == "B"), default=None)
    result = StepResult()
    loss_sum = torch.zeros((), dtype=torch.float64, device=state.device)
    saved: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        for k, (action, exchange) in enumerate(zip(actions, exchanges(plan, actions, gen.me))):
            p, s, i = action.pipeline, action.stage, action.micro
            if on_phase is not None:
                on_phase("forward" if action.kind == "F" else "backward", step=step, detail=i)
            if action.kind == "F":
                x, out, ids, counts = forward(action, exchange, step)
                if s == plan.pipelines[p].n_stages - 1:
                    out = out * scale
                    if counts:
                        loss_sum += out.detach().double()
                        result.sample_ids.extend(ids)
                saved[(p, s, i)] = (x, out)
                continue
            x, out = saved.pop((p, s, i))
            if k == last_backward:
                sync.watch()
            if s == plan.pipelines[p].n_stages - 1:
                with busy:
                    out.backward()
            else:
                grad = forward.hidden()
                forward.links.receive(grad, exchange.receive)
                with busy:
                    out.backward(grad)
            if s > 0:
                forward.links.send(x.grad.contiguous(), exchange)
    finally:
        sync.close()
    forward.links.finish()
    finite = torch.isfinite(loss_sum) & state.grads_finite()  # the device's own, before the sums land
    sync.finish(None if on_phase is None else functools.partial(on_phase, "sync", step=step))
    figures = [loss_sum, finite]
    if train.clip_norm > 0:
        figures.append(state.grad_sum_of_squares(norm_regions or {}))
    read = torch.cat([f.double().reshape(1) for f in figures]).tolist()  # the step's one host read
    result.busy_s = busy.seconds  # after the read: an accelerator's timing events have completed
    result.loss_sum, result.finite = read[0], bool(read[1])
    result.norm_sq = read[2] if train.clip_norm > 0 else None
    return result


def evaluate(
    step: int,
    *,
    plan: Plan,
    actions: list[Action],
    state: StageState,
    stream: SampleStream,
    gen: Generation,
    model: ModelConfig,
    train: TrainConfig,
    tp: TensorParallelOps | None,
    on_phase: Callable[..., None] | None = None,
    pace: Callable[[float], float] | None = None,
) -> float:
    """The validation loss before step ``step``, this device's part: forward only, nothing kept or committed.

    The plan's pipelines run ``train.eval_batches`` global batches of validation
    samples (batch ``j`` holds samples ``[j·B, (j+1)·B)``, split over pipelines as a
    step's are) in the forward order of the step's 1F1B lists; each last stage
    adds up its summed token loss over ``eval_batches · global_batch · seq_len``,
    so the parts of all devices sum to the mean token loss. ``on_phase("eval",
    step=step, detail=j)`` is called as batch ``j`` starts; ``pace`` as in :func:`run_step`.
    """
    forward = _Forwards(plan=plan, state=state, stream=stream, gen=gen, model=model, train=train, tp=tp,
                        busy=_Busy(pace, state.device))
    forwards = [a for a in actions if a.kind == "F"]
    traffic = exchanges(plan, forwards, gen.me)
    total = torch.zeros((), dtype=torch.float64, device=state.device)
    with torch.no_grad():
        for batch in range(train.eval_batches):
            if on_phase is not None:
                on_phase("eval", step=step, detail=batch)
            for action, exchange in zip(forwards, traffic):
                _, out, _, counts = forward(action, exchange, batch)
                if counts:
                    total += out.double()
            forward.links.finish()
    return total.item() / (train.eval_batches * train.global_batch * train.seq_len)


def sync_gradients(
    rounds: SyncRounds, *, state: StageState, gen: Generation, on_round: Callable[..., None] | None = None
) -> None:
    """Sum every gradient over the devices holding the same shard, round by coloured round (:class:`GradientSync`
    with one bucket per group, none launched before)."""
    GradientSync(rounds, state=state, gen=gen, bucket_bytes=math.inf).finish(on_round)


@dataclass
class _Bucket:
    """Some tensors of one sync group, summed in one all-reduce: those whose gradients are not final yet, and once
    launched, its work and how to put the sums in place."""

    sync: SyncGroup
    round: int
    missing: set[str]
    work: dist.Work | None = None
    unpack: Callable[[], None] | None = None


class GradientSync:
    """One step's gradient sync: every gradient summed over the devices holding the same shard.

    Every device walks the same coloured rounds in the same order; within a round the
    groups are device-disjoint, so this device is in at most one. Each group's tensors
    are cut into buckets of at most ``bucket_bytes``, last layers first (the order the
    backward finishes them). :meth:`watch`, called before this device's last backward,
    launches each bucket as soon as that backward has made its gradients final, in
    this device's order of buckets (rounds, then buckets): every member of a group
    launches its buckets in the same order, and no device posts a round before its
    earlier ones (NCCL's rule for communicators used at once), so the sync overlaps the
    rest of the backward. The sums are written to the sums' buffers, not the gradients,
    until :meth:`finish`: until then the gradients are this device's own.
    """

    def __init__(self, rounds: SyncRounds, *, state: StageState, gen: Generation, bucket_bytes: float):
        self.rounds, self.state, self.gen = rounds, state, gen
        self.buckets = [_Bucket(part, r, set(part.names)) for r, groups in enumerate(rounds) for sync in groups
                        if gen.me in sync.devices for part in cut_buckets(sync, state.regions, bucket_bytes)]
        self.launched = 0
        self.hooks: list = []

    def watch(self) -> None:
        """From now on a gradient is final once accumulated: launch each bucket as soon as its gradients are."""
        owner = {name: bucket for bucket in self.buckets for name in bucket.sync.names}
        self.hooks = self.state.on_gradient(owner, lambda name: self._final(owner[name], name))

    def _final(self, bucket: _Bucket, name: str) -> None:
        bucket.missing.discard(name)
        self._launch(ready_only=True)

    def _launch(self, *, ready_only: bool) -> None:
        """Launch the next buckets in order: those ready, or (``ready_only`` False) all that are left."""
        while self.launched < len(self.buckets) and not (ready_only and self.buckets[self.launched].missing):
            bucket = self.buckets[self.launched]
            bucket.work, bucket.unpack = _post_sum(bucket.sync, state=self.state, gen=self.gen)
            self.launched += 1

    def finish(self, on_round: Callable[..., None] | None = None) -> None:
        """Launch the buckets left, then wait for them round by round and put the sums in place.

        ``on_round(detail=r)`` is called as round ``r`` is waited for (before the first, even with no rounds).
        """
        self.close()
        self._launch(ready_only=False)
        if on_round is not None and not self.rounds:
            on_round(detail=-1)
        for r in range(len(self.rounds)):
            if on_round is not None:
                on_round(detail=r)
            for bucket in (b for b in self.buckets if b.round == r):
                self.gen.wait(bucket.work)
                bucket.unpack()

    def close(self) -> None:
        """Stop watching gradients (a step that fails leaves no hook behind)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def cut_buckets(sync: SyncGroup, regions: Mapping[str, Region], bucket_bytes: float) -> list[SyncGroup]:
    """``sync``'s tensors (of which a device holds ``regions``) in buckets of at most ``bucket_bytes`` of fp32
    gradients (a larger tensor alone), last tensors first."""
    parts: list[list[int]] = []
    size = 0.0
    for k in reversed(range(len(sync.names))):
        shape = sync.shapes[k] if sync.shapes is not None else [b - a for a, b in regions[sync.names[k]]]
        nbytes = 4 * math.prod(shape)  # fp32 gradients
        if not parts or size + nbytes > bucket_bytes:
            parts.append([])
            size = 0.0
        parts[-1].append(k)
        size += nbytes
    return [replace(sync, names=tuple(sync.names[k] for k in part),
                    shapes=None if sync.shapes is None else tuple(sync.shapes[k] for k in part)) for part in parts]


def _post_sum(sync: SyncGroup, *, state: StageState, gen: Generation) -> tuple[dist.Work, Callable[[], None]]:
    """Start summing ``sync``'s gradients over its devices (a copy in one flat buffer); the work, and how to put the
    sums into the gradients once it is done."""
    grads = state.grads(sync.names)
    if sync.shapes is None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        sums = [piece.view_as(g) for piece, g in zip(torch.split(flat, [g.numel() for g in grads]), grads, strict=True)]
    else:
        flat, sums = _padded(grads, sync, state=state, me=gen.me)
    work = gen.post_all_reduce(flat, sync.devices)

    def unpack() -> None:
        torch._foreach_copy_(grads, sums)

    return work, unpack


def _padded(grads: list[torch.Tensor], sync: SyncGroup, *, state: StageState, me: int
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Holders of different TP sizes: the whole tensors in one flat buffer of zeros, this device's regions placed in
    it (a tensor it holds whole as zeros, if ``sync.zeroed`` names it), and the views of those regions."""
    boxes = [tuple((0, n) for n in shape) for shape in sync.shapes]
    flat = torch.zeros(sum(math.prod(shape) for shape in sync.shapes), dtype=grads[0].dtype, device=grads[0].device)
    views, offset = [], 0
    for g, name, shape, box in zip(grads, sync.names, sync.shapes, boxes, strict=True):
        whole = flat[offset : offset + math.prod(shape)].view(shape)
        offset += whole.numel()
        view = whole[local_slices(state.regions[name], box)]
        views.append(view)
        if state.regions[name] != box or me not in sync.zeroed:
            view.copy_(g)
    return flat, views
