"""A re-layout's peak memory on each device, measured against the memory model (``relayout_memory``).

    python benchmarks/bench_relayout_memory.py [--dim 512] [--n-layers 8] [--vocab 4096] [--json FILE]

Four gloo worker processes hold the state of a dp2 × pp2 plan (fp32 weights, gradients and AdamW's two moments,
as a worker keeps them) and run three real manifests with ``execute_manifest``, as a recovery does: device 3
lost and device 2 taking its stage over (the ``redundant`` move), device 3 back and empty (a growth), and a
change of TP (dp2 × pp2 → pp2 × tp2). Each transition starts from fresh state. A device's measured peak is its
peak resident memory during the transition less its resident memory before its state was made, under a fixed
mmap threshold (``MALLOC_MMAP_THRESHOLD_``: every tensor's pages go back when it is freed, so the resident peak
is the live peak, as ``max_memory_allocated`` is on an accelerator); the estimate is ``relayout_memory`` with
the model's costs, the figure the selector checks a recovery against. Also the plan's steady peak (Eq. 14,
without activations) for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

# glibc: every block above 128 KiB mapped alone and unmapped when freed, and filled when allocated (its pages are
# resident from then on, as an accelerator's allocation is)
LIVE = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10), "MALLOC_PERTURB_": "1"}

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import HOST, TIMEOUT_S, header, launch  # noqa: E402

MIB = 2**20
WORLD = 4
KINDS = ("param", "exp_avg", "exp_avg_sq")  # what a move carries; the gradient stays beside them


def _status_kib(key: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1])


def transitions(cfg):
    """(name, old plan, new plan, survivors, manifest) of each measured re-layout."""
    from chameleon.layout.plan import even_plan, plan_from_spec
    from chameleon.layout.relayout import relabel_plan, relayout
    from chameleon.layout.spec import layout_of
    from chameleon.model.llama import TP_RULES, param_shapes, stage_param_names

    shapes, names = param_shapes(cfg), partial(stage_param_names, cfg)
    n, batch = cfg.n_layers, 8
    a = even_plan(dp=2, pp=2, tp=1, n_layers=n, global_batch=batch, micro_batch=1)
    slots = plan_from_spec([{"layers": [n // 2, n - n // 2], "micro_batches": 4}, {"layers": [n], "micro_batches": 4}],
                           tp=1, n_layers=n, global_batch=batch, micro_batch=1)
    merged = relabel_plan(slots, {0: 0, 1: 1, 2: 2})
    tp2 = even_plan(dp=1, pp=2, tp=2, n_layers=n, global_batch=batch, micro_batch=1)

    def layout(plan):
        return layout_of(plan, shapes, names, rules=TP_RULES)

    return [(name, old, new, alive, relayout(layout(old), layout(new), survivors=alive)) for name, old, new, alive in (
        ("device 3 lost, device 2 takes its stage over", a, merged, (0, 1, 2)),
        ("device 3 back, empty: grown to dp2 × pp2", merged, a, (0, 1, 2, 3)),
        ("dp2 × pp2 → pp2 × tp2", a, tp2, (0, 1, 2, 3)))]


def measure(rank: int, world: int, store, args) -> list[dict]:
    import torch

    from chameleon.layout.spec import region_shape
    from chameleon.model.config import ModelConfig
    from chameleon.runtime.worker.comm import Generation, connect_store
    from chameleon.runtime.worker.transfer import execute_manifest

    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=8, n_kv_heads=4, vocab_size=args.vocab,
                      multiple_of=64)
    moves = transitions(cfg)
    pairs = sorted({tuple(sorted((m.src, m.dst))) for *_, manifest in moves for r in manifest.rounds for m in r})
    gen = Generation(connect_store=lambda: connect_store(HOST, store.inner.port, timeout_s=TIMEOUT_S), generation=0,
                     me=rank, backend="gloo", timeout_s=TIMEOUT_S, groups=[tuple(range(world)), *pairs],
                     flagged=lambda: False)
    out = []
    for i, (_, _, _, _, manifest) in enumerate(moves):
        gen.all_reduce(torch.zeros(1), tuple(range(world)))  # a barrier: every device starts the transition together
        before = _status_kib("VmRSS")
        held = manifest.before.get(rank, {})
        state = {kind: {n: torch.randn(region_shape(r)) for n, r in held.items()} for kind in (*KINDS, "grad")}
        grads = state.pop("grad")
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory starts again from now
        new = execute_manifest(manifest, me=rank, state=state, links=gen, stamp=1)
        peak = (_status_kib("VmHWM") - before) * 1024
        out.append({"transition": i, "device": rank, "measured_bytes": peak})
        del state, grads, new
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in LIVE.items()):  # glibc reads them at start: run again under them
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **LIVE})
    from chameleon.layout import memory
    from chameleon.model.config import ModelConfig
    from chameleon.model.spec import spec_of

    header("gloo, 4 worker processes, 1 thread each, " + " ".join(f"{k}={v}" for k, v in LIVE.items()))
    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=8, n_kv_heads=4, vocab_size=args.vocab,
                      multiple_of=64)
    print(f"model: dim {args.dim}, {args.n_layers} layers, vocab {args.vocab}; state fp32 (weight, gradient, two "
          "moments)")
    costs = spec_of(cfg).memory_costs(cfg, micro_batch=1, seq_len=1)
    moves = transitions(cfg)
    measured = {(r["transition"], r["device"]): r["measured_bytes"]
                for rows in launch(measure, WORLD, args) for r in rows}
    rows = []
    print(f"{'transition':<46} {'device':>6} {'estimate MiB':>12} {'measured MiB':>12} {'meas/est':>8} "
          f"{'steady MiB':>10}")
    for i, (name, old, new, _, manifest) in enumerate(moves):
        estimate = memory.relayout_memory(costs, manifest, old, new)
        steady = memory.plan_memory(costs, new)
        for d in sorted(estimate):
            row = {"transition": name, "device": d, "estimate_mib": estimate[d] / MIB,
                   "measured_mib": measured[i, d] / MIB, "measured_over_estimate": measured[i, d] / estimate[d],
                   "steady_mib": steady.get(d, 0.0) / MIB}
            rows.append(row)
            print(f"{name:<46} {d:>6} {row['estimate_mib']:>12.1f} {row['measured_mib']:>12.1f} "
                  f"{row['measured_over_estimate']:>8.3f} {row['steady_mib']:>10.1f}")
    ratios = [r["measured_over_estimate"] for r in rows]
    print(f"measured ÷ estimate: {min(ratios):.3f} to {max(ratios):.3f} over {len(rows)} device transitions")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
