"""Failure-free step time: Chameleon's worker data path against a plain PyTorch loop, side by side.

Run: ``python benchmarks/bench_step.py [--layouts 4x1x1 2x2x1 2x1x2] [--rounds 4] [--steps 10] [--bucket-mb 25]
[--json FILE]``.

A layout is ``DPxPPxTP``. Both run in the same gloo worker processes, on the same model
(the functional Llama of the model spec, ``chameleon.model.spec``; 12 layers: 111 tensors),
the same initial parameters (each rank's shard) and the same samples, alternating A, B, A, B
(``--rounds`` pairs of ``--warmup`` + ``--steps`` steps each):

- **ours**: the worker's data path — ``step_actions`` once, then per step ``run_step``
  (1F1B over a :class:`Generation`'s fault-polled sends/receives, coloured gradient
  sync in buckets launched as the last backward finishes them, Megatron TP over the
  generation's groups) and the AdamW step (multi-tensor ops).
  The controller's commit round trip is not included.
- **plain**: per pipeline a ``PipelineStage`` + ``Schedule1F1B`` over an nn.Module whose
  forward calls ``stage_forward`` on ``nn.ParameterDict``-held tensors (with one stage, a
  loop of forward/backward over the micro-batches; with TP, Megatron's collectives as plain
  ``dist.all_reduce`` calls on the TP group), then one flat-bucket all-reduce over the
  stage's DP group and ``torch.optim.AdamW(foreach=True)``.

Every step starts after a barrier; its time is the slowest rank's. The table gives the
median over all measured steps and each side's optimizer time per step (median over ranks
and steps), with the per-tensor loop the stage used before (``adamw`` one tensor at a
time) timed on the same state; ``--profile`` adds a cProfile of ours on rank 0.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import TIMEOUT_S, Timings, compare, header, launch, timed
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from chameleon.config import DataConfig, TrainConfig
from chameleon.data.stream import micro_batch_samples, open_streams
from chameleon.layout.geometry import geometry_of, sync_rounds
from chameleon.layout.groups import plan_groups
from chameleon.layout.plan import Plan, even_plan, micro_batch_ranges
from chameleon.layout.schedule import step_actions
from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of
from chameleon.optim import MOMENTS, adamw, hyperparameters
from chameleon.runtime.worker.comm import Generation
from chameleon.runtime.worker.schedule import run_step
from chameleon.runtime.worker.stage import StageState, role_of

CPU = torch.device("cpu")
# The plain side runs torch.optim.AdamW at a constant rate, unclipped: so does ours.
TRAIN = TrainConfig(lr_schedule="constant", warmup_steps=0, clip_norm=0.0)


class FunctionalStage(nn.Module):
    """A pipeline stage as an nn.Module: ``stage_forward`` over parameters held in a ParameterDict."""

    def __init__(self, params: dict[str, torch.Tensor], model: ModelConfig, *, layers, first: bool, last: bool, tp):
        super().__init__()
        self.names = {n: n.replace(".", "_") for n in params}  # ParameterDict keys cannot hold dots
        self.params = nn.ParameterDict({k: nn.Parameter(params[n].clone()) for n, k in self.names.items()})
        self.model, self.layers, self.first, self.last, self.tp = model, layers, first, last, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = {n: self.params[k] for n, k in self.names.items()}
        return spec_of(self.model).stage_forward(params, self.model, x, layers=self.layers, first=self.first,
                                                 last=self.last, tp=self.tp)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _worker(rank: int, world: int, store, model: ModelConfig, train: dict, plan: Plan, args) -> dict:
    stream = open_streams(DataConfig(), seq_len=train.seq_len, seed=train.seed).train
    role = role_of(plan, rank)
    stage = plan.pipelines[role.pipeline].stages[role.stage]
    first, last = role.first, role.last
    state = StageState.create(model, role, seed=train.seed, train=train, device=CPU)

    # Plain PyTorch: the default group for barriers, a group per pipeline, per stage replica set, per TP stage.
    dist.init_process_group("gloo", store=dist.PrefixStore("plain", store), rank=rank, world_size=world)
    pipe_groups = [dist.new_group(list(p.devices)) for p in plan.pipelines] if role.n_stages > 1 else None
    replicas = {(s, t): [p.stages[s].devices[t] for p in plan.pipelines] for s in range(role.n_stages)
                for t in range(stage.tp)}
    dp_groups = {key: dist.new_group(members) for key, members in sorted(replicas.items())}
    tp_groups = {st.devices: dist.new_group(list(st.devices)) for p in plan.pipelines for st in p.stages if st.tp > 1}
    spec = spec_of(model)
    plain_tp = spec.tp_ops(partial(dist.all_reduce, group=tp_groups[stage.devices])) if stage.tp > 1 else None
    module = FunctionalStage(state.tensors()["param"], model, layers=stage.layers, first=first, last=last, tp=plain_tp)
    micro = plan.pipelines[role.pipeline].micro_batches
    schedule = None
    if role.n_stages > 1:
        pstage = PipelineStage(module, role.stage, role.n_stages, CPU, group=pipe_groups[role.pipeline])
        schedule = Schedule1F1B(pstage, n_microbatches=micro, loss_fn=_loss)
    plain_params = list(module.parameters())
    torch_adamw = torch.optim.AdamW(plain_params, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
                                    weight_decay=train.weight_decay, foreach=True)
    block = micro_batch_ranges(plan)[role.pipeline]
    plain_losses: list[float] = []
    optimizer_s: dict[str, list[float]] = {"ours": [], "plain": [], "per_tensor": []}

    def plain_step(step: int) -> None:
        ids = [i for m in block for i in micro_batch_samples(
            step, m, global_batch=train.global_batch, micro_batch_size=plan.micro_batch_size)]
        tokens, targets = stream.batch(ids)
        if schedule is None:
            losses = []
            for x, y in zip(tokens.chunk(micro), targets.chunk(micro)):
                loss = _loss(module(x), y) / micro
                loss.backward()
                losses.append(loss.detach())
            plain_losses.append(torch.stack(losses).sum().item())
        elif first:
            schedule.step(tokens)
        elif last:
            losses: list[torch.Tensor] = []
            schedule.step(target=targets, losses=losses)
            plain_losses.append(torch.stack(losses).mean().item())
        else:
            schedule.step()
        flat = torch.cat([p.grad.reshape(-1) for p in plain_params])
        if plan.dp > 1:
            dist.all_reduce(flat, group=dp_groups[(role.stage, role.tp_index)])
            flat /= plan.dp
        offset = 0
        for p in plain_params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        t0 = time.perf_counter()
        torch_adamw.step()
        optimizer_s["plain"].append(time.perf_counter() - t0)
        torch_adamw.zero_grad(set_to_none=True)

    # Ours: the worker's data path over one Generation.
    layout = spec.layout(model, plan)
    rounds = sync_rounds(geometry_of(plan), layout)
    gen = Generation(connect_store=lambda: store, generation=0,
                     me=rank, backend="gloo", timeout_s=TIMEOUT_S,
                     groups=plan_groups(plan, spec_of(model).layout(model, plan)))
    ours_tp = spec.tp_ops(partial(gen.all_reduce, members=stage.devices)) if stage.tp > 1 else None
    actions = step_actions(plan)[rank]
    ours_losses: list[float] = []

    def ours_step(step: int) -> None:
        result = run_step(step, plan=plan, actions=actions, state=state, stream=stream, gen=gen, model=model,
                          train=train, rounds=rounds, tp=ours_tp)
        if last:
            ours_losses.append(result.loss_sum)
        t0 = time.perf_counter()
        state.optimizer_step(step)
        optimizer_s["ours"].append(time.perf_counter() - t0)

    impls = {"ours": ours_step, "plain": plain_step}
    counters = dict.fromkeys(impls, 0)
    times: Timings = {k: [] for k in impls}
    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    for _ in range(args.rounds):
        for name, fn in impls.items():
            times[name].append([])
            for k in range(args.warmup + args.steps):
                profiling = profiler is not None and name == "ours" and k >= args.warmup
                if profiling:
                    profiler.enable()
                dt = timed(partial(fn, counters[name]), dist.barrier)
                if profiling:
                    profiler.disable()
                counters[name] += 1
                if k >= args.warmup:
                    times[name][-1].append(dt)
    held = state.tensors()
    grads = {n: torch.randn_like(t) for n, t in held["param"].items()}
    for _ in range(args.steps):  # the stage's update before multi-tensor ops: the pure adamw, one tensor at a time
        t0 = time.perf_counter()
        for n in held["param"]:
            adamw({n: held["param"][n]}, {n: grads[n]}, {k: {n: held[k][n]} for k in MOMENTS}, 1, lr=train.lr,
                  **hyperparameters(train))
        optimizer_s["per_tensor"].append(time.perf_counter() - t0)
    report = None
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
        report = out.getvalue()
    dist.destroy_process_group()
    # Loss of step 0, as this pipeline's share of the global mean (ours sums scaled losses; plain averages).
    share = plan.pipelines[role.pipeline].micro_batches / plan.n_micro_batches
    loss0 = (ours_losses[0], plain_losses[0] * share) if last and stage.devices[0] == rank else (0.0, 0.0)
    return {"times": times, "loss0": loss0, "profile": report, "tensors": len(held["param"]),
            "optimizer_ms": {k: 1e3 * statistics.median(v) for k, v in optimizer_s.items()}}


def _plan(layout: str, model: ModelConfig, train: dict) -> Plan:
    dp, pp, tp = map(int, layout.split("x"))
    return even_plan(dp=dp, pp=pp, tp=tp, n_layers=model.n_layers, global_batch=train.global_batch,
                     micro_batch=train.micro_batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["4x1x1", "2x2x1", "2x1x2"], help="DPxPPxTP")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="A/B pairs")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps at the start of every block")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per block")
    parser.add_argument("--bucket-mb", type=float, default=TRAIN.bucket_mb,
                        help="ours: the gradient sync's bucket size (each all-reduced as the last backward finishes it)")
    parser.add_argument("--profile", action="store_true", help="cProfile ours on rank 0")
    parser.add_argument("--json", type=Path, help="write one object per layout here")
    args = parser.parse_args()
    model = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
    train = replace(TRAIN, global_batch=args.global_batch, micro_batch=args.micro_batch, seq_len=args.seq_len,
                    bucket_mb=args.bucket_mb)
    header()
    print(f"model: dim {model.dim}, {model.n_layers} layers, {model.n_heads} heads ({model.n_kv_heads} kv), vocab "
          f"{model.vocab_size}; batch {args.global_batch}×{args.seq_len} tokens, micro-batch {args.micro_batch}; "
          f"{args.rounds}× (ours, plain) blocks of {args.warmup}+{args.steps} steps; ours: {args.bucket_mb:g} MB buckets")
    print(f"{'layout':>7} {'procs':>5} {'tensors':>7} {'ours ms':>8} {'plain ms':>9} {'ours/plain':>10} "
          f"{'plain/ours tok/s':>16} {'CPU ours/plain':>14}  {'optimizer ms ours | plain | per-tensor':<38} "
          f"step-0 loss ours | plain")
    profiles, rows = [], []
    tokens = args.global_batch * args.seq_len
    for layout in args.layouts:
        plan = _plan(layout, model, train)
        if plan.pipelines[0].n_stages > 1 and plan.pipelines[0].stages[0].tp > 1:
            parser.error(f"--layouts {layout}: the plain side pipelines stages of one device (PP or TP, not both)")
        world = len(plan.devices)
        results = launch(_worker, world, model, train, plan, args)
        wall, cpu, blocks = compare([r["times"] for r in results], "ours", "plain")
        loss_ours, loss_plain = (sum(r["loss0"][i] for r in results) for i in (0, 1))
        opt = {k: statistics.median(r["optimizer_ms"][k] for r in results) for k in ("ours", "plain", "per_tensor")}
        row = {"layout": layout, "chameleon_tokens_per_s": tokens / (wall["ours"] / 1e3),
               "plain_tokens_per_s": tokens / (wall["plain"] / 1e3), "ratio": wall["plain"] / wall["ours"],
               "tensors_per_stage": max(r["tensors"] for r in results), "per_block_ours_over_plain": blocks,
               "optimizer_ms": opt}
        rows.append(row)
        print(f"{layout:>7} {world:>5} {row['tensors_per_stage']:>7} {wall['ours']:>8.1f} {wall['plain']:>9.1f} "
              f"{wall['ours'] / wall['plain']:>10.3f} {row['ratio']:>16.3f} {cpu['ours'] / cpu['plain']:>14.3f}  "
              f"{opt['ours']:>8.2f} | {opt['plain']:>6.2f} | {opt['per_tensor']:>9.2f}{'':<10} "
              f"{loss_ours:.5f} | {loss_plain:.5f}", flush=True)
        profiles += [(layout, r["profile"]) for r in results if r["profile"]]
    print("ratio = Chameleon's tokens/s ÷ plain PyTorch's (goal ≥ 1.0); per block ours/plain wall:")
    for row in rows:
        print(f"  {row['layout']}: {row['per_block_ours_over_plain']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    for layout, text in profiles:
        print(f"\ncProfile of ours, rank 0, {layout} (measured steps):\n{text}")


if __name__ == "__main__":
    main()
