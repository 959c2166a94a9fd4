"""Profiler: a real (short) measurement on this CPU, its cache, and the analytic profile."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from chameleon.decision.config import ClusterConfig
from chameleon.decision import profiler
from chameleon.decision.profiler import (
    TPTerms, analytic_profile, count_tp_all_reduces, load_profile, measure_tensor_parallel as profiler_probe,
    ring_all_reduce_s, tp_terms,
)
from chameleon.model import llama
from chameleon.model.config import ModelConfig


def test_measured_profile_is_real_and_cached(tmp_path, monkeypatch):
    model = ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=64)
    cluster = ClusterConfig(comm_procs=2, cache_dir=str(tmp_path), n_devices=4)
    timed = []  # what the profiler's real TP probe measured, as it returned it

    def probe(*args, **kwargs):
        timed.append(profiler_probe(*args, **kwargs))
        return timed[-1]

    monkeypatch.setattr(profiler, "measure_tensor_parallel", probe)
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
    assert len(list(tmp_path.glob("*.json"))) == 1 and len(timed) == 1
    # A TP=2 stage: the layer a real TP probe timed across 2 gloo processes (when this host has 2 cores),
    # not half the compute plus two all-reduces priced from the DP probe.
    tp2 = load_profile(model, cluster, micro_batch=2, seq_len=16, tp=2)
    assert tp2.tp == 2 and [terms.tp for terms in prof.tp_terms] == [2]
    if prof.host_cores >= 2:
        fwd, bwd, fwd_idle, bwd_idle = timed[0][2]
        assert list(timed[0]) == [2] and (tp2.layer_fwd_s, tp2.layer_bwd_s) == pytest.approx((fwd, bwd), rel=1e-9)
        assert prof.tp_extra(2)[3:] == (fwd_idle, bwd_idle) and 0 <= fwd_idle <= fwd and 0 <= bwd_idle <= bwd
        derived = prof.layer_fwd_s / 2 + 2 * ring_all_reduce_s(prof.dp_latency_s, prof.dp_bw, prof.boundary_bytes, 2)
        assert tp2.layer_fwd_s != pytest.approx(derived, rel=1e-6)
    assert (tp2.first_fwd_s, tp2.last_bwd_s) == (prof.first_fwd_s, prof.last_bwd_s)  # replicated: whole
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_tp_terms_of_sizes_not_measured_grow_as_the_all_reduce():
    ring = lambda t: 0.0 if t < 2 else 1.0 + 0.5 * (t - 1) / t  # noqa: E731 - seconds of one all-reduce
    measured = TPTerms(2, 3.0, 4.0, 1.0, 2.0)
    terms = {t.tp: t for t in tp_terms((1, 2, 4, 8), {2: measured}, ring, (2, 3))}
    assert sorted(terms) == [2, 4, 8] and terms[2] == measured  # measured: as it was
    for t in (4, 8):  # the growth of 2 forward and 3 backward all-reduces, spent waiting
        grow = ring(t) - ring(2)
        assert terms[t][1:] == pytest.approx((3.0 + 2 * grow, 4.0 + 3 * grow, 1.0 + 2 * grow, 2.0 + 3 * grow))
    # nothing measured: each all-reduce as the DP probe prices it
    assert tp_terms((1, 2), {}, ring, (2, 2)) == (TPTerms(2, *[2 * ring(2)] * 4),)


def test_tp_all_reduces_are_counted_on_the_layer():
    model = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=64)
    names = llama.stage_param_names(model, (0, 1), first=False, last=False)
    params = {n: t.requires_grad_() for n, t in llama.LLAMA.init_params(model, 0, names=names).items()}
    x = torch.randn(2, 8, 32, requires_grad=True)
    assert count_tp_all_reduces(model, params, x, recompute="none") == (2, 2)  # Megatron's f and g, twice a layer
    forward, backward = count_tp_all_reduces(model, params, x, recompute="full")
    assert forward == 2 and backward > 2  # the backward reruns (part of) the forward and its all-reduces


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
