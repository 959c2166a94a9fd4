"""The check a lent GPU machine runs in a few minutes: Chameleon's accelerator path, measured, into one JSON.

    python benchmarks/device_check.py [--json FILE]

Each section runs in a process of its own under a time limit, so a hang, or a
process the communication library tears down, costs only that section (its exit
status is then part of what it measured):

- ``communicator``: an NCCL communicator built as Chameleon builds it (non-blocking,
  eagerly) and as c10d does by default (at the first op): build and first-op
  times, device memory per communicator, and the device-memory slope over 20
  build → all-reduce → abort cycles with the aborted communicators kept
  referenced (as abandoned generations are) and released.
- ``stuck_abort``: an all-reduce stuck behind a long kernel (``torch.cuda._sleep``),
  aborted from a side thread within a bound; then whether the context still
  computes and builds a new communicator.
- ``error_mode:N``: the same stuck all-reduce under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=N``
  with a 3 s timeout: does the op raise in the worker, or is the process torn down?
- ``llama_stage``: one ~1.4 B Llama stage (GQA) in bf16 at 4,096 tokens: tokens/s and
  MFU of forward + backward, the attention kernel that ran, peak memory measured
  beside Chameleon's estimate, and Chameleon's optimizer step beside
  ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)``.
- ``d2h``: device → host GB/s into pageable and into pinned memory.
- ``recovery``: a 4-worker run sharing ``cuda:0`` over gloo (bf16) through a SIGKILL.
- ``nccl_recovery`` (two or more GPUs): NCCL workers, one per GPU, through a SIGKILL.
- ``accelerator_tests``: ``pytest -m accelerator`` (state on the device stepping like the CPU;
  workers sharing one GPU, and NCCL workers, recovering a kill like their failure-free runs).

With no CUDA device it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
PEAK_BF16_FLOPS = 989.4e12  # H100/H200 SXM dense bf16, NVIDIA's datasheet
MIB = 2**20
CYCLES = 20
SM_HZ = 1.98e9  # the H200's top SM clock: _sleep counts cycles, so a slower clock only sleeps longer
SECTIONS = {  # name → time limit, s
    "communicator": 120, "stuck_abort": 90, "error_mode:0": 40, "error_mode:1": 40, "error_mode:2": 40,
    "error_mode:3": 40, "llama_stage": 240, "d2h": 60, "recovery": 240, "nccl_recovery": 240,
    "accelerator_tests": 300,
}
RUN = ("train.steps=30", "train.dtype=bf16", "failure=kill", "failure.rank=1", "failure.step=15",
       "failure.phase=backward", "ckpt=none", "output.progress=false")


def emit(**fields) -> None:
    """One JSON line on stdout: the section's progress so far (its last line is its result)."""
    print(json.dumps(fields), flush=True)


def device_used() -> int:
    """Bytes in use on the device, by anyone (the CUDA context and NCCL's buffers too)."""
    free, total = torch.cuda.mem_get_info()
    return total - free


def nccl_group(store, prefix: str, *, chameleon: bool = True, timeout_s: float = 60.0):
    """A one-rank NCCL group: built as Chameleon builds it, or with c10d's defaults (lazy, blocking)."""
    import torch.distributed as dist

    from chameleon.runtime.worker.comm import build_group

    sub = dist.PrefixStore(prefix, store)
    if chameleon:
        return build_group("nccl", sub, 0, 1, timedelta(seconds=timeout_s), None, torch.device("cuda", 0))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(sub, 0, 1, options)


def wait_done(work, limit_s: float) -> float | None:
    """Seconds until ``work`` completed (polled), or None past ``limit_s``."""
    t0 = time.perf_counter()
    while not work.is_completed():
        if time.perf_counter() - t0 > limit_s:
            return None
        time.sleep(1e-4)
    return time.perf_counter() - t0


def slope_mib(samples: list[int]) -> float:
    """Least-squares MiB per cycle of ``samples`` (bytes)."""
    n = len(samples)
    mean_x, mean_y = (n - 1) / 2, sum(samples) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(samples))
    return num / sum((i - mean_x) ** 2 for i in range(n)) / MIB


def section_communicator() -> None:
    import torch.distributed as dist

    from chameleon.runtime.worker.completion import abort, apply_library_policy

    apply_library_policy("nccl")
    torch.cuda.set_device(0)
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    store = dist.HashStore()
    result = {"context_mib": device_used() / MIB}
    for label, chameleon in (("c10d_default", False), ("chameleon", True)):
        before = device_used()
        t0 = time.perf_counter()
        group = nccl_group(store, label, chameleon=chameleon)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        first = wait_done(group.allreduce([x]), 60.0)
        result[label] = {"build_s": built, "first_op_s": first, "build_plus_first_op_s": built + (first or 0.0),
                         "mib_per_communicator": (device_used() - before) / MIB}
        abort([group])
        emit(**result)
    for label, keep in (("kept", True), ("released", False)):
        held, samples = [], []
        for i in range(CYCLES):
            group = nccl_group(store, f"{label}{i}")
            wait_done(group.allreduce([x]), 60.0)
            abort([group])
            if keep:
                held.append(group)
            del group
            gc.collect()
            torch.cuda.synchronize()
            samples.append(device_used())
        result[f"leak_{label}_mib_per_cycle"] = slope_mib(samples)
        result[f"leak_{label}_total_mib"] = (samples[-1] - samples[0]) / MIB
        emit(**result)


def _stuck_allreduce(sleep_s: float, timeout_s: float):
    """A one-rank NCCL all-reduce queued behind a ``sleep_s`` kernel on the current stream."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    x = torch.ones(1 << 20, device="cuda")
    try:
        group = nccl_group(dist.HashStore(), "stuck", timeout_s=timeout_s)
    except Exception as err:  # noqa: BLE001 - recorded; the rest is still measured on c10d's default build
        emit(chameleon_build_error=f"{type(err).__name__}: {err}")
        group = nccl_group(dist.HashStore(), "stuck-default", chameleon=False, timeout_s=timeout_s)
    wait_done(group.allreduce([x]), 60.0)  # connected and warm
    torch.cuda._sleep(int(sleep_s * SM_HZ))
    return group, group.allreduce([x])


def healthy() -> bool:
    """The context still computes and builds and uses a new communicator."""
    import torch.distributed as dist

    a = torch.randn(1024, 1024, device="cuda")
    ok = bool(torch.isfinite(a @ a).all())
    group = nccl_group(dist.HashStore(), "after")
    return ok and wait_done(group.allreduce([torch.ones(8, device="cuda")]), 30.0) is not None


def section_stuck_abort() -> None:
    from chameleon.runtime.worker.completion import abort, apply_library_policy

    apply_library_policy("nccl")
    sleep_s, bound_s = 8.0, 10.0
    group, work = _stuck_allreduce(sleep_s, timeout_s=60.0)
    time.sleep(0.5)
    result = {"sleep_s": sleep_s, "bound_s": bound_s, "stuck": not work.is_completed()}
    aborted = threading.Event()
    t0 = time.perf_counter()
    threading.Thread(target=lambda: (abort([group]), aborted.set()), daemon=True).start()
    result["aborted_within_bound"] = aborted.wait(bound_s)
    result["abort_s"] = time.perf_counter() - t0
    emit(**result)
    torch.cuda.synchronize()
    result["healthy_after"] = healthy()
    emit(**result)


def section_error_mode(mode: str) -> None:
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = mode
    timeout_s, sleep_s = 3.0, 10.0
    _, work = _stuck_allreduce(sleep_s, timeout_s=timeout_s)
    t0 = time.perf_counter()
    result = {"mode": int(mode), "timeout_s": timeout_s, "sleep_s": sleep_s, "posted": True}
    emit(**result)
    done = wait_done(work, sleep_s + 10.0)
    result["completed_after_s"] = done
    try:
        work.wait()
        result["raised"] = None
    except Exception as err:  # noqa: BLE001 - what the worker would see is the measurement
        result["raised"] = f"{type(err).__name__}: {str(err)[:200]}"
    result["returned_after_s"] = time.perf_counter() - t0
    emit(**result)
    torch.cuda.synchronize()
    result["healthy_after"] = healthy()
    emit(**result)


def section_llama_stage() -> None:
    from chameleon.config import TrainConfig
    from chameleon.layout.memory import stage_memory
    from chameleon.layout.plan import even_plan
    from chameleon.model.config import ModelConfig
    from chameleon.model.spec import spec_of
    from chameleon.runtime.worker.stage import StageState, role_of

    seq, layers = 4096, 24
    cfg = ModelConfig(name="1.4b", dim=2048, n_layers=layers, n_heads=16, n_kv_heads=8, vocab_size=32000,
                      multiple_of=256, max_seq_len=seq)
    spec = spec_of(cfg)
    train = TrainConfig(dtype="bf16", clip_norm=1.0)
    role = role_of(even_plan(dp=1, pp=1, tp=1, n_layers=layers, global_batch=1, micro_batch=1), 0)
    torch.cuda.set_device(0)
    state = StageState.create(cfg, role, seed=0, train=train, device=torch.device("cuda", 0))
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), device="cuda")
    x, y = tokens[:, :-1], tokens[:, 1:]
    n_params = spec.param_count(cfg)
    result = {"params": n_params, "seq_len": seq, "dtype": "bf16", "context_mib": device_used() / MIB}

    def compute() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        spec.stage_forward(state.params, cfg, x, layers=(0, layers), first=True, last=True, targets=y).backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def optimizer(step: int) -> float:
        t0 = time.perf_counter()
        state.optimizer_step(step, grad_norm=2.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for step in range(2):  # warm-up
        compute()
        optimizer(step)
    torch.cuda.reset_peak_memory_stats()
    timed = [(compute(), optimizer(step)) for step in range(2, 7)]
    compute_s = sorted(c for c, _ in timed)[len(timed) // 2]
    flops_per_token = 6 * n_params + 12 * layers * cfg.dim * seq
    estimate = stage_memory(spec.memory_costs(cfg, micro_batch=1, seq_len=seq, dtype="bf16"), layers, first=True,
                            last=True, in_flight=1, synced=False)
    result.update(
        tokens_per_s=seq / compute_s, forward_backward_s=compute_s,
        mfu=flops_per_token * seq / compute_s / PEAK_BF16_FLOPS,
        chameleon_optimizer_s=sorted(o for _, o in timed)[len(timed) // 2],
        peak_allocated_mib=torch.cuda.max_memory_allocated() / MIB,
        peak_reserved_mib=torch.cuda.max_memory_reserved() / MIB, estimated_mib=estimate / MIB,
    )
    result["measured_over_estimate"] = result["peak_allocated_mib"] / result["estimated_mib"]
    emit(**result)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compute()
    names = {e.key for e in prof.key_averages()}
    result["attention_kernels"] = sorted(n[:90] for n in names if any(
        k in n.lower() for k in ("flash", "fmha", "attention", "sdpa", "efficient", "softmax")))[:8]
    emit(**result)
    for label, kwargs in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        params = [p.detach().clone().requires_grad_(True) for p in state.tensors()["param"].values()]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **kwargs)
        opt.step()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        result[f"torch_adamw_{label}_s"] = sorted(times)[2]
        del opt, params
        gc.collect()
        torch.cuda.empty_cache()
    result["chameleon_over_fused"] = result["chameleon_optimizer_s"] / result["torch_adamw_fused_s"]
    emit(**result)


def section_d2h() -> None:
    torch.cuda.set_device(0)
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    result = {"bytes": src.numel() * 4}

    def rate(copy) -> float:
        copy()
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return result["bytes"] / min(times) / 1e9

    result["pageable_gb_s"] = rate(lambda: src.to("cpu"))
    result["pinned_gb_s"] = rate(lambda: pinned.copy_(src, non_blocking=True))
    emit(**result)


def recovery_run(overrides: tuple[str, ...]) -> None:
    """A default-model run through one SIGKILL: its recovery and throughput."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        proc = subprocess.run([sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", *RUN, *overrides],
                              cwd=tmp, env=ENV, capture_output=True, text=True, timeout=SECTIONS["recovery"] - 10)
        if proc.returncode != 0:
            emit(returncode=proc.returncode, stderr=proc.stderr[-1500:])
            return
        summary = json.loads((run_dir / "summary.json").read_text())
    (rec,) = summary["recoveries"]
    emit(overrides=list(overrides), chosen=rec["chosen"], recovery_s=rec["total_s"],
         samples_per_s=summary["samples_per_s"], final_loss=summary["final_loss"], steps=len(summary["losses"]))


def section_recovery() -> None:
    recovery_run(("launcher.device=cuda", "launcher.backend=gloo", "launcher.nproc_per_node=4"))


def section_nccl_recovery() -> None:
    workers = min(torch.cuda.device_count(), 4)
    recovery_run(("launcher.device=cuda", f"launcher.nproc_per_node={workers}", "parallel=dp"))


def section_accelerator_tests() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "accelerator", "-rs", "tests/test_accelerator.py"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=SECTIONS["accelerator_tests"] - 10)
    lines = proc.stdout.strip().splitlines()
    emit(returncode=proc.returncode, outcome=lines[-1] if lines else proc.stderr[-500:],
         failures=proc.stdout[-3000:] if proc.returncode else None)


def run_section(name: str) -> dict:
    """Run one section in its own process; its last JSON line, exit status and wall time."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--section", name], env=ENV, capture_output=True, text=True,
                              timeout=SECTIONS[name])
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        stdout, stderr, code = err.stdout or "", err.stderr or "", "timeout"
        stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    out = {"exit": code, "wall_s": round(time.perf_counter() - t0, 2), **(json.loads(lines[-1]) if lines else {})}
    if code != 0:
        out["stderr_tail"] = stderr[-1200:]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=Path("device_check.json"), help="where the results go")
    parser.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        name, _, mode = args.section.partition(":")
        globals()[f"section_{name}"](*([mode] if mode else []))
        return
    if not torch.cuda.is_available():
        print("device_check: needs a CUDA device and none is visible; nothing was checked")
        return
    n = torch.cuda.device_count()
    report = {"device": torch.cuda.get_device_name(0), "gpus": n, "torch": torch.__version__,
              "cuda": torch.version.cuda, "nccl": str(torch.cuda.nccl.version()), "sections": {}}
    print(f"device_check: {n} × {report['device']}, torch {report['torch']}, CUDA {report['cuda']}, "
          f"NCCL {report['nccl']}", flush=True)
    for name in SECTIONS:
        if name == "nccl_recovery" and n < 2:
            report["sections"][name] = {"skipped": "needs two or more GPUs"}
            continue
        report["sections"][name] = result = run_section(name)
        print(f"{name}: {json.dumps(result)}", flush=True)
        args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
