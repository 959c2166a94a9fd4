"""Accelerator-resident training state (``-m accelerator``; skipped where no CUDA device is visible).

``benchmarks/device_check.py`` runs these on a GPU host (its ``accelerator_tests`` section). Each compares with the
same computation on the CPU, which every other test already checks against the
single-process reference.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import SMALL_RUN, run_entry
from test_faults import BF16_LOSS_TOLERANCE

from chameleon.config import TrainConfig
from chameleon.layout.plan import even_plan
from chameleon.model.config import ModelConfig
from chameleon.report.compare import relative_difference
from chameleon.runtime.checkpoint import CheckpointWriter
from chameleon.runtime.worker.stage import KINDS, StageState, role_of

pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)
TRAIN = TrainConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, lr_schedule="cosine",
                    warmup_steps=1, steps=4, min_lr=1e-3)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_state_stays_on_the_device_and_steps_like_the_cpu(dtype):
    role = role_of(even_plan(dp=1, pp=1, tp=1, n_layers=2, global_batch=2, micro_batch=1), 0)
    states = {d: StageState.create(CFG, role, seed=0, train=replace(TRAIN, dtype=dtype), device=torch.device(d))
              for d in ("cpu", "cuda")}
    for state in states.values():
        for step in range(3):
            loss = sum(p.float().square().sum() for p in state.params.values())
            loss.backward()
            state.optimizer_step(step, grad_norm=2.0)
    gpu = states["cuda"].tensors()
    assert all(t.device.type == "cuda" and t.dtype == torch.float32 for kind in KINDS for t in gpu[kind].values())
    assert all(p.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype] for p in states["cuda"].params.values())
    cpu = states["cpu"].tensors()
    for kind in KINDS:
        assert relative_difference({n: t.cpu() for n, t in gpu[kind].items()}, cpu[kind]) <= 1e-5


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_workers_sharing_one_gpu_over_gloo_recover_a_kill(tmp_path, dtype):
    """Four workers on cuda:0 (gloo, host-staged sends) lose one and finish like their failure-free run."""
    common = (*SMALL_RUN, "launcher.device=cuda", "launcher.backend=gloo", f"train.dtype={dtype}",
              "launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2")
    clean = run_entry("train", tmp_path / "clean", *common)
    faulty = run_entry("train", tmp_path / "faulty", *common, "failure=kill", "failure.rank=1", "failure.step=3", "failure.phase=backward")
    for run in (clean, faulty):
        assert run.returncode == 0, run.stderr
    assert faulty.summary["recoveries"] and faulty.summary["sample_ids_digest"] == clean.summary["sample_ids_digest"]
    peaks = clean.summary["device_peak_mb"]  # each allocator's, beside the model's estimate
    assert set(peaks) == set(clean.summary["memory_estimate_mb"])
    assert all(0 < p["allocated"] <= p["reserved"] for p in peaks.values()), peaks
    tolerance = 1e-5 if dtype == "fp32" else BF16_LOSS_TOLERANCE
    for a, b in zip(faulty.summary["losses"], clean.summary["losses"], strict=True):
        assert abs(a - b) <= tolerance * abs(b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per worker: 2 or more")
def test_nccl_workers_recover_a_kill(tmp_path):
    n = min(4, torch.cuda.device_count())
    common = (*SMALL_RUN, "launcher.device=cuda", f"launcher.nproc_per_node={n}")  # data parallel
    clean = run_entry("train", tmp_path / "clean", *common)
    faulty = run_entry("train", tmp_path / "faulty", *common, "failure=kill", "failure.rank=1", "failure.step=3",
                       "failure.phase=backward")
    for run in (clean, faulty):
        assert run.returncode == 0, run.stderr
    assert faulty.summary["recoveries"] and not faulty.leftover_workers()
    for a, b in zip(faulty.summary["losses"], clean.summary["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_a_snapshot_from_the_device_is_the_state_at_the_save_though_training_goes_on(tmp_path):
    """The device → host copies go into pinned buffers, queued on the stream: an update right after ``save_async``
    returns does not reach the file, and the next save reuses the buffers."""
    shards = {"param": {"w": torch.randn(256, 256, device="cuda")}}
    writer = CheckpointWriter(tmp_path, device=0)
    for step in (1, 2):
        before = shards["param"]["w"].cpu()
        path = writer.save_async(step, shards, regions={"w": ((0, 256), (0, 256))}, committed_steps=step)
        shards["param"]["w"].mul_(-2).add_(1)  # training goes on at once
        writer.wait()
        assert torch.equal(torch.load(path)["param"]["w"], before)
        assert writer._pinned[("param", "w")].is_pinned()
