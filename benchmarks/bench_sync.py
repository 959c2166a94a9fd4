"""Gradient sync on uneven plans: the coloured, bucketed sync against one all-reduce per layer.

Run: ``python benchmarks/bench_sync.py [--plans 3+4 2+3] [--dims 128 512] [--rounds 3] [--iters 10]``.

``3+4`` is two pipelines of 3 and 4 stages over 7 processes (layers split as
``split_layers`` does). Every worker holds its stage's parameters of the real model
(8 layers) with random gradients, in real gloo processes over one :class:`Generation`:

- **coloured**: ``sync_gradients`` over ``sync_rounds(geometry, layout)`` — what the runtime
  runs: tensors with the same holder set share one flat bucket, buckets are coloured
  into rounds of device-disjoint all-reduces.
- **per layer**: for the embedding, each layer, then the final norm and the output
  head in order, one flat all-reduce of that unit's gradients over its holders.

Both go through the same fault-polled ``Generation.all_reduce``. The two methods are
checked to give identical sums. Each sync starts after a barrier; its time is the
slowest rank's; A and B alternate in blocks (``--rounds`` pairs).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.distributed as dist
from _common import TIMEOUT_S, Timings, compare, header, launch, timed

from chameleon.config import TrainConfig
from chameleon.layout.geometry import geometry_of, sync_rounds
from chameleon.layout.plan import Plan, plan_from_spec, split_layers
from chameleon.layout.spec import Layout
from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of
from chameleon.runtime.worker.comm import Generation
from chameleon.runtime.worker.schedule import sync_gradients
from chameleon.runtime.worker.stage import StageState, role_of

# The plain side runs torch.optim.AdamW at a constant rate, unclipped: so does ours.
TRAIN = TrainConfig(lr_schedule="constant", warmup_steps=0, clip_norm=0.0)


def layer_units(layout: Layout) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """``(holders, names)`` per layer in model order: embedding, each layer, norm, output."""
    units: dict[str, list[str]] = {}
    for name in layout:
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name
        units.setdefault(key, []).append(name)
    return [(tuple(sorted(h.devices[0] for h in layout[names[0]].holders)), tuple(names)) for names in units.values()]


def _worker(rank: int, world: int, store, model: ModelConfig, plan: Plan, args) -> dict:
    dist.init_process_group("gloo", store=dist.PrefixStore("barrier", store), rank=rank, world_size=world)
    layout = spec_of(model).layout(model, plan)
    rounds = sync_rounds(geometry_of(plan), layout)
    units = layer_units(layout)
    gen = Generation(connect_store=lambda: store, generation=0,
                     me=rank, backend="gloo", timeout_s=TIMEOUT_S,
                     groups=[g.devices for groups in rounds for g in groups] + [d for d, _ in units])
    state = StageState.create(model, role_of(plan, rank), seed=0, train=TRAIN, device=torch.device("cpu"))
    torch.manual_seed(rank)
    grads = {n: torch.randn_like(p) for n, p in state.params.items()}

    def fill() -> None:
        for n, p in state.params.items():
            p.grad = grads[n].clone()

    def per_layer() -> None:
        for devices, names in units:
            if rank not in devices or len(devices) < 2:
                continue
            held = state.grads(names)
            flat = torch.cat([g.reshape(-1) for g in held])
            gen.all_reduce(flat, devices)
            offset = 0
            for g in held:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    impls = {"coloured": partial(sync_gradients, rounds, state=state, gen=gen), "per layer": per_layer}
    results = {}
    for name, fn in impls.items():
        fill()
        fn()
        results[name] = {n: p.grad.clone() for n, p in state.params.items()}
    same = all(torch.equal(results["coloured"][n], results["per layer"][n]) for n in state.params)
    times: Timings = {k: [] for k in impls}
    for _ in range(args.rounds):
        for name, fn in impls.items():
            times[name].append([])
            for k in range(args.warmup + args.iters):
                fill()
                dt = timed(fn, dist.barrier)
                if k >= args.warmup:
                    times[name][-1].append(dt)
    dist.destroy_process_group()
    return {"times": times, "same": same, "elems": sum(p.numel() for p in state.params.values())}


def uneven_plan(lengths: list[int], n_layers: int) -> Plan:
    """Pipelines of the given stage counts, layers split as ``split_layers`` does, one micro-batch each."""
    spec = [{"layers": [hi - lo for lo, hi in split_layers(n_layers, k)], "micro_batches": 1} for k in lengths]
    return plan_from_spec(spec, tp=1, n_layers=n_layers, global_batch=len(lengths), micro_batch=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", nargs="+", default=["3+4", "2+3"], help="stage counts of the pipelines")
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="A/B pairs")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10, help="measured syncs per block")
    args = parser.parse_args()
    header()
    print(f"{'plan':>5} {'procs':>5} {'dim':>4} {'params':>7} {'max MB/dev':>10} {'buckets/rounds':>14} {'layer ARs':>9} "
          f"{'coloured ms':>11} {'per-layer ms':>12} {'col/layer':>9} {'CPU ratio':>9}  per-block col/layer ms  same sums")
    for spec in args.plans:
        lengths = [int(k) for k in spec.split("+")]
        plan = uneven_plan(lengths, args.n_layers)
        world = len(plan.devices)
        for dim in args.dims:
            model = ModelConfig(dim=dim, n_layers=args.n_layers, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32)
            layout = spec_of(model).layout(model, plan)
            rounds = sync_rounds(geometry_of(plan), layout)
            n_groups, n_rounds = sum(map(len, rounds)), len(rounds)
            n_units = sum(len(d) > 1 for d, _ in layer_units(layout))
            out = launch(_worker, world, model, plan, args)
            wall, cpu, blocks = compare([r["times"] for r in out], "coloured", "per layer")
            col, lay = wall["coloured"], wall["per layer"]
            mb = max(r["elems"] for r in out) * 4 / 2**20
            print(f"{spec:>5} {world:>5} {dim:>4} {spec_of(model).param_count(model) / 1e6:>6.2f}M {mb:>10.1f} "
                  f"{f'{n_groups}/{n_rounds}':>14} {n_units:>9} {col:>11.1f} {lay:>12.1f} {col / lay:>9.3f}  "
                  f"{cpu['coloured'] / cpu['per layer']:>9.3f}  {blocks:<22} {all(r['same'] for r in out)}", flush=True)


if __name__ == "__main__":
    main()
