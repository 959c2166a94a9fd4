"""Profiler: a real (short) measurement on this CPU, its cache, and the analytic profile."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from chameleon.decision.config import ClusterConfig
from chameleon.decision.profiler import analytic_profile, load_profile
from chameleon.model import llama
from chameleon.model.config import ModelConfig


def test_measured_profile_is_real_and_cached(tmp_path):
    model = ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=64)
    cluster = ClusterConfig(comm_procs=2, cache_dir=str(tmp_path), n_devices=4)
    threads = torch.get_num_threads()
    prof = load_profile(model, cluster, micro_batch=2, seq_len=16)
    assert torch.get_num_threads() == threads  # measured with the workers' 1 thread, then restored
    assert "1 threads" in prof.source and prof.host_cores == len(os.sched_getaffinity(0))
    assert prof.layer_fwd_s > 0 and prof.layer_bwd_s > 0 and prof.last_fwd_s > 0
    layer_names = llama.stage_param_names(model, (0, 1), first=False, last=False)
    assert prof.layer_params == llama.LLAMA.param_bytes(model, layer_names, bytes_per_elem=1)
    assert prof.layer_act_bytes >= 2 * 16 * 32 * 4  # at least the layer input is kept
    assert prof.p2p_bw > 0 and prof.dp_bw > 0 and prof.group_create_s > 0
    assert prof.background_procs >= 0 and 0 < prof.commit_s < 1
    again = load_profile(model, replace(cluster, comm_procs=4), micro_batch=2, seq_len=16)
    assert again == prof  # served from the JSON cache, no new measurement
    assert len(list(tmp_path.glob("*.json"))) == 1
    # A TP=2 stage: half the layer compute plus two all-reduces of the layer's activations each way.
    tp2 = load_profile(model, cluster, micro_batch=2, seq_len=16, tp=2)
    all_reduce = prof.dp_latency_s + (2 * 16 * 32 * 4) / prof.dp_bw  # 2(tp−1)/tp = 1 at tp = 2
    assert tp2.tp == 2 and tp2.layer_fwd_s == pytest.approx(prof.layer_fwd_s / 2 + 2 * all_reduce)
    assert tp2.layer_bwd_s == pytest.approx(prof.layer_bwd_s / 2 + 2 * all_reduce)
    assert (tp2.first_fwd_s, tp2.last_bwd_s) == (prof.first_fwd_s, prof.last_bwd_s)  # replicated: whole
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_analytic_llama7b_on_a100():
    model = ModelConfig(name="llama7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                        multiple_of=256)
    cluster = ClusterConfig(name="a100", kind="analytic", n_devices=32, peak_tflops=312.0, mfu=0.5,
                            memory_gb=80.0, hbm_gbps=2039.0, intra_gbps=300.0, inter_gbps=25.0)
    prof = analytic_profile(model, cluster, micro_batch=1, seq_len=4096, tp=1)
    total = 32 * prof.layer_params + prof.first_params + prof.last_params
    assert total == llama.LLAMA.param_count(model) == pytest.approx(6.74e9, rel=0.01)
    tokens = 4096
    assert prof.layer_fwd_s == pytest.approx((2 * prof.layer_params * tokens + 2 * tokens * 4096 * 4096) / 156e12)
    assert prof.layer_bwd_s == pytest.approx(2 * prof.layer_fwd_s)
    assert prof.dp_bw == 25e9  # 4 nodes: DP sync crosses the network
