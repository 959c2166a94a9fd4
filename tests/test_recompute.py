"""Activation recomputation (``train.recompute``): the same math, less kept, the rest priced.

The oracle of the math is the same stage without recomputation; of the memory, what autograd really
keeps (counted with saved-tensor hooks) against :meth:`ModelSpec.layer_activations`.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_RUN, run_entry

from chameleon.config import TrainConfig
from chameleon.decision.config import ClusterConfig
from chameleon.decision.profiler import KeptStorages, analytic_profile
from chameleon.layout.memory import stage_memory
from chameleon.model.config import ModelConfig
from chameleon.model.spec import Recompute, spec_of

LLAMA_CFG = ModelConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, max_seq_len=64)
GPT_CFG = ModelConfig(arch="gpt", dim=64, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=96, max_seq_len=64)
SEQ, BATCH = 48, 2


def stage(cfg: ModelConfig):
    spec = spec_of(cfg)
    params = {n: (t + 0.05 * torch.randn_like(t)).requires_grad_(True) for n, t in spec.init_params(cfg, 0).items()}
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return spec, params, tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("cfg", [LLAMA_CFG, GPT_CFG], ids=["llama", "gpt"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_loss_and_gradients(cfg, recompute):
    spec, params, x, y = stage(cfg)
    results = {}
    for mode in ("none", recompute):
        for p in params.values():
            p.grad = None
        loss = spec.stage_forward(params, cfg, x, layers=(0, cfg.n_layers), first=True, last=True, targets=y,
                                  recompute=mode)
        loss.backward()
        results[mode] = loss.detach(), {n: p.grad.clone() for n, p in params.items()}
    (loss0, grads0), (loss1, grads1) = results["none"], results[recompute]
    assert torch.allclose(loss1, loss0, rtol=1e-6, atol=0)
    for n in grads0:
        assert torch.allclose(grads1[n], grads0[n], rtol=1e-5, atol=1e-7), n


def kept_bytes(cfg: ModelConfig, recompute: str) -> int:
    """Bytes one layer's forward leaves alive for its backward (its input, as the stage's, not counted)."""
    spec, params, _, _ = stage(cfg)
    hidden = torch.randn(BATCH, SEQ, cfg.dim, requires_grad=True)
    with KeptStorages() as kept:
        out = spec.stage_forward(params, cfg, hidden, layers=(0, 1), first=False, last=False, recompute=recompute)
    return kept.alive(besides=(out, hidden, *params.values()))


@pytest.mark.parametrize("cfg", [LLAMA_CFG, GPT_CFG], ids=["llama", "gpt"])
def test_what_a_layer_keeps_is_what_the_memory_model_counts(cfg):
    """Measured within 15 % of the model under none and selective; full keeps only the layer's input, here
    not counted (it is the stage's)."""
    spec = spec_of(cfg)
    measured = {mode: kept_bytes(cfg, mode) for mode in Recompute}
    model = {mode: 4 * spec.layer_activations(cfg, micro_batch=BATCH, seq_len=SEQ, recompute=mode)[0]
             for mode in Recompute}
    for mode in ("none", "selective"):
        assert abs(measured[mode] - model[mode]) <= 0.15 * model[mode], (mode, measured, model)
    assert measured["full"] <= 0.15 * model["full"] and model["full"] == 4 * BATCH * SEQ * cfg.dim
    assert measured["full"] < measured["selective"] < 0.75 * measured["none"]


def test_recomputation_makes_a_stage_fit_and_costs_compute():
    """On an 80 GB accelerator a Llama-2 7B stage of 16 layers at 4,096 tokens × 8 micro-batches in flight does not
    fit without recomputation and does with it; the analytic profile prices the rerun forward into backward."""
    cfg = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, max_seq_len=4096)
    cluster = ClusterConfig(name="a100", kind="analytic", n_devices=8, devices_per_node=8, memory_gb=80.0,
                            dtype="bf16", peak_tflops=312.0, mfu=0.5, hbm_gbps=2000.0, intra_gbps=300.0, inter_gbps=25.0)
    need = {}
    for mode in Recompute:
        profile = analytic_profile(cfg, cluster, micro_batch=1, seq_len=4096, tp=1, recompute=mode)
        need[mode] = stage_memory(profile.memory_costs, 16, first=True, last=False, in_flight=8, synced=True)
        assert profile.layer_bwd_s >= 2 * profile.layer_fwd_s
        if mode == "full":
            assert profile.layer_bwd_s == pytest.approx(3 * profile.layer_fwd_s)
    assert need["full"] < 80e9 < need["none"]
    assert need["full"] < need["selective"] <= need["none"]


@pytest.mark.full
@pytest.mark.parametrize("layout", [("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.tp=2"),
                                    ("launcher.nproc_per_node=2", "parallel.dp=1", "parallel.pp=2")],
                         ids=["dp2xtp2", "pp2"])
def test_a_run_with_recomputation_trains_like_one_without(tmp_path, layout):
    """Full recomputation reruns the TP all-reduces of a layer in its backward; selective the attention core."""
    runs = {mode: run_entry("train", tmp_path / mode, *SMALL_RUN, *layout, "failure=none", f"train.recompute={mode}")
            for mode in Recompute}
    for run in runs.values():
        assert run.returncode == 0, run.stderr
    base = runs["none"].summary
    for mode in ("selective", "full"):
        got = runs[mode].summary
        assert got["sample_ids_digest"] == base["sample_ids_digest"]
        for a, b in zip(got["losses"], base["losses"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (mode, got["losses"], base["losses"])


def test_a_bad_recompute_is_one_line(tmp_path):
    run = run_entry("train", tmp_path / "run", *SMALL_RUN, "train.recompute=some")
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].endswith(
        "train.recompute='some': use none, selective, full")
    assert TrainConfig().recompute == "none"


@pytest.mark.full
def test_each_worker_records_its_peak_beside_the_estimate(tmp_path):
    """summary.json: every worker's measured peak (RSS on CPUs) beside the memory model's bytes for its device;
    recomputation lowers the estimate, and no worker's peak is below it (the peak adds the runtime)."""
    job = (*SMALL_RUN, "launcher.nproc_per_node=2", "model.dim=256", "train.seq_len=64", "report.plots=false")
    runs = {mode: run_entry("train", tmp_path / mode, *job, f"train.recompute={mode}") for mode in ("none", "full")}
    for run in runs.values():
        assert run.returncode == 0, run.stderr
    estimates = {}
    for mode, run in runs.items():
        peaks, estimate = run.summary["peak_rss_mb"], run.summary["memory_estimate_mb"]
        assert set(peaks) == set(estimate) == {"0", "1"}
        assert all(peaks[d] > estimate[d] > 0 for d in peaks), (peaks, estimate)
        assert run.summary["device_peak_mb"] == {}  # an allocator's peaks on accelerators only
        estimates[mode] = estimate
    assert all(estimates["full"][d] < estimates["none"][d] for d in estimates["none"])
