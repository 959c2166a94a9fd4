"""A stage's peak memory, measured against the memory model (Eq. 14), under each ``train.recompute``.

    python benchmarks/bench_memory.py [--dim 512] [--n-layers 8] [--seq-len 512] [--micro-batch 4] [--json FILE]

Each mode runs in fresh processes, as one worker of a one-stage plan: the stage's state
(``StageState``: fp32 masters, gradients, AdamW moments), ``--steps`` steps of one
micro-batch's forward + backward and the optimizer step. A peak is the process's
peak resident memory less its resident memory before the state was made (the
interpreter, torch, the data), taken twice: under glibc's default allocator (which keeps
freed blocks of up to 32 MiB for reuse: resident memory grows over the steps), and with a
fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``), where every tensor's pages go back when it
is freed, so the resident peak is the live peak, what an accelerator's allocator reports as
``max_memory_allocated``. The estimate is ``stage_memory`` of the model's ``memory_costs``
under that mode, the figure config validation and the planner use. Also per mode: what the
forward kept for backward (live storages, as the profiler counts it) against the model's
activations, and the median forward + backward time (default allocator).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header  # noqa: E402

MODES = ("none", "selective", "full")
MIB = 2**20
LIVE = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}  # glibc: every block above 128 KiB mapped alone, unmapped when freed


def rss_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm, in pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(args, mode: str) -> dict:
    import torch

    from chameleon.config import TrainConfig
    from chameleon.decision.profiler import KeptStorages
    from chameleon.layout.memory import stage_memory
    from chameleon.layout.plan import even_plan
    from chameleon.model.config import ModelConfig
    from chameleon.model.spec import spec_of
    from chameleon.runtime.worker.stage import StageState, role_of

    torch.set_num_threads(1)
    cfg = ModelConfig(dim=args.dim, n_layers=args.n_layers, n_heads=8, n_kv_heads=4, vocab_size=args.vocab,
                      multiple_of=64, max_seq_len=args.seq_len)
    spec = spec_of(cfg)
    train = TrainConfig(recompute=mode, clip_norm=1.0)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    role = role_of(even_plan(dp=1, pp=1, tp=1, n_layers=cfg.n_layers, global_batch=args.micro_batch,
                             micro_batch=args.micro_batch), 0)
    before = rss_bytes()
    state = StageState.create(cfg, role, seed=0, train=train, device=torch.device("cpu"))
    layers = (0, cfg.n_layers)
    times, kept = [], 0
    for step in range(args.steps):
        t0 = time.perf_counter()
        with KeptStorages() as live:
            loss = spec.stage_forward(state.params, cfg, x, layers=layers, first=True, last=True, targets=y,
                                      recompute=mode)
        kept = live.alive(besides=(loss, *state.params.values(), *state.tensors()["param"].values()))
        loss.backward()
        times.append(time.perf_counter() - t0)
        state.optimizer_step(step, grad_norm=1.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    costs = spec.memory_costs(cfg, micro_batch=args.micro_batch, seq_len=args.seq_len, recompute=mode)
    estimate = stage_memory(costs, cfg.n_layers, first=True, last=True, in_flight=1, synced=False)
    acts = cfg.n_layers * costs.acts.layer + costs.acts.last
    return {"mode": mode, "peak_mib": peak / MIB, "estimate_mib": estimate / MIB, "peak_over_estimate": peak / estimate,
            "kept_mib": kept / MIB, "activations_model_mib": acts / MIB, "kept_over_model": kept / acts,
            "forward_backward_s": statistics.median(times[1:] or times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args, args.mode)))
        return
    header("one process, 1 thread")
    print(f"model: dim {args.dim}, {args.n_layers} layers, vocab {args.vocab}; micro-batch {args.micro_batch} × "
          f"{args.seq_len} tokens; {args.steps} steps per mode, each mode in a fresh process")
    rows = []
    shape = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("dim", "n_layers", "vocab", "seq_len", "micro_batch",
                                                                     "steps")]

    def run(mode: str, env: dict) -> dict:
        out = subprocess.run([sys.executable, __file__, *shape, f"--mode={mode}"], capture_output=True, text=True,
                             check=True, env={**os.environ, **env})
        return json.loads(out.stdout.strip().splitlines()[-1])

    for mode in MODES:
        live = run(mode, LIVE)
        rows.append({**run(mode, {}), "live_peak_mib": live["peak_mib"], "live_over_estimate": live["peak_over_estimate"]})
    print(f"{'recompute':>9} {'live MiB':>9} {'estimate MiB':>12} {'live/est':>8} {'RSS MiB':>8} {'RSS/est':>7} "
          f"{'kept MiB':>9} {'model MiB':>9} {'kept/model':>10} {'fwd+bwd s':>9} {'time vs none':>12}")
    base = rows[0]
    for r in rows:
        print(f"{r['mode']:>9} {r['live_peak_mib']:>9.0f} {r['estimate_mib']:>12.0f} {r['live_over_estimate']:>8.3f} "
              f"{r['peak_mib']:>8.0f} {r['peak_over_estimate']:>7.3f} "
              f"{r['kept_mib']:>9.0f} {r['activations_model_mib']:>9.0f} {r['kept_over_model']:>10.3f} "
              f"{r['forward_backward_s']:>9.3f} {r['forward_backward_s'] / base['forward_backward_s']:>12.3f}")
    print(f"saving vs none (live peak): selective {1 - rows[1]['live_peak_mib'] / base['live_peak_mib']:.1%}, "
          f"full {1 - rows[2]['live_peak_mib'] / base['live_peak_mib']:.1%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
