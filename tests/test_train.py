"""End-to-end training with real worker processes against the single-process reference."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

from chameleon.config import CONF_DIR, register_configs
from chameleon.model.config import ModelConfig
from chameleon.model.llama import LLAMA
from chameleon.report.breakdown import TIME_PARTS
from chameleon.report.compare import relative_difference
from conftest import ENV, SMALL_RUN, TP_PARAMS, assert_same_clipping, run_entry

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
TOLERANCE = 1e-5  # relative, fp32: only floating-point reassociation differs between layouts


@pytest.mark.full
@pytest.mark.parametrize(
    "layout",
    [
        ("launcher.nproc_per_node=2",),
        ("launcher.nproc_per_node=4",),
        ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2"),
        ("launcher.nproc_per_node=4", "parallel.dp=1", "parallel.pp=4"),
        ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.tp=2"),
        ("launcher.nproc_per_node=4", "parallel.dp=1", "parallel.pp=2", "parallel.tp=2"),
        ("launcher.nproc_per_node=7", "parallel.pipelines=[{layers:[1,2,1],micro_batches:2},{layers:[1,1,1,1],micro_batches:2}]"),
        ("launcher.nproc_per_node=5", "parallel.pipelines=[{layers:[2,2],micro_batches:1},{layers:[1,1,2],micro_batches:3}]"),
        ("launcher.nproc_per_node=5", "parallel.pipelines=[{layers:[2,2],micro_batches:2,tp:2},{layers:[4],micro_batches:2}]"),
        # a bucket per tensor: each all-reduced as the last backward makes it final, overlapping the rest
        ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2", "train.bucket_mb=0.01"),
        ("launcher.nproc_per_node=5", "parallel.pipelines=[{layers:[2,2],micro_batches:2,tp:2},{layers:[4],micro_batches:2}]",
         "train.bucket_mb=0.01"),
        ("launcher.nproc_per_node=2", "train.compile=true"),  # inductor's kernels: within the same tolerance
    ],
    ids=["dp2", "dp4", "dp2xpp2", "pp4", "dp2xtp2", "pp2xtp2", "uneven3+4", "uneven2+3", "tp2+tp1", "dp2xpp2-buckets",
         "tp2+tp1-buckets", "dp2-compiled"],
)
def test_layout_reproduces_single_process(tmp_path, reference_run, layout):
    run = run_entry("train", tmp_path / "run", *SMALL_RUN, *layout)
    assert run.returncode == 0, run.stderr
    ref, got = reference_run.summary, run.summary
    assert got["steps_completed"] == ref["steps_completed"] == 6
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= TOLERANCE * abs(b)
    tolerance = TP_PARAMS.param_tolerance if "tp" in " ".join(layout) else TOLERANCE
    assert relative_difference(run.params, reference_run.params) <= tolerance
    assert got["sample_ids_digest"] == ref["sample_ids_digest"]
    assert run.stdout.strip().splitlines()[-1] == str(run.run_dir / "summary.json")
    # one global norm over every pipeline, stage and TP shard, clipped at every step, as in one process
    assert_same_clipping(run, reference_run, clip_norm=0.5)


@pytest.mark.full
def test_clipping_is_exact_while_a_stage_is_rerouted(tmp_path, reference_run):
    """A kill reroutes a lost stage's micro-batches to its peer: the norm still counts every tensor once."""
    run = run_entry("train", tmp_path / "run", *SMALL_RUN, "launcher.nproc_per_node=4", "parallel.dp=2",
                    "parallel.pp=2", "policy.name=reroute", "failure=kill", "failure.rank=3", "failure.step=2",
                    "failure.phase=forward", *(("report.tensorboard=true",) if HAS_TENSORBOARD else ()))
    assert run.returncode == 0, run.stderr
    assert [r["chosen"] for r in run.summary["recoveries"]] == ["reroute"]
    assert (run.run_dir / "run.png").is_file()
    if HAS_TENSORBOARD:  # mirrored live by the launching process
        assert list((run.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    for a, b in zip(run.summary["losses"], reference_run.summary["losses"], strict=True):
        assert abs(a - b) <= TOLERANCE * abs(b)
    assert relative_difference(run.params, reference_run.params) <= TOLERANCE
    assert_same_clipping(run, reference_run, clip_norm=0.5)
    summary, (recovery,) = run.summary, run.summary["recoveries"]
    parts = summary["time_breakdown_s"]  # every second of the run in one part
    assert list(parts) == list(TIME_PARTS) and sum(parts.values()) == pytest.approx(summary["wall_s"], rel=1e-9)
    assert summary["ettr"] == pytest.approx(parts["productive"] / summary["wall_s"]) and 0 < summary["ettr"] < 1
    for part, key in (("detection", "detect_s"), ("decision", "decide_s"), ("restore", "restore_s")):
        assert parts[part] == pytest.approx(recovery[key], abs=1e-6), part
    assert parts["redone"] > 0 and parts["startup"] == pytest.approx(summary["startup_s"])
    assert recovery["steady_step_s"] > 0, "the estimate is compared with the steady steps after the recovery"
    assert f"steady step {recovery['steady_step_s']:.3f} s vs" in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("chameleon: effective training time ")


@pytest.mark.full
def test_outputs(reference_run):
    lines = [json.loads(x) for x in (reference_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(6))
    assert {"loss", "samples_per_s", "tokens_per_s", "step_time_s"} <= lines[0].keys()
    summary = reference_run.summary
    assert summary["world_size"] == 1 and summary["final_loss"] == summary["losses"][-1]
    assert summary["losses"][-1] < summary["losses"][0]  # it learns
    assert (reference_run.run_dir / ".hydra" / "config.yaml").is_file()


@pytest.mark.full
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("launcher.nproc_per_node=3", "parallel.dp=2"), "launcher.nproc_per_node"),
        (("launcher.nproc_per_node=8", "parallel.dp=1", "parallel.pp=8", "model.n_layers=4"), "parallel.pp"),
        (("train.global_batch=10", "train.micro_batch=4"), "train.micro_batch"),
        (("launcher.nproc_per_node=2", "parallel.tp=2", "parallel.dp=1", "parallel.pp=1", "model.n_kv_heads=1"), "parallel.tp"),
        (("launcher.device=tpu",), "launcher.device"),
        pytest.param(("launcher.device=cuda",), "launcher.device=cuda",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
        (("launcher.device=npu",), "torch_npu"),  # torch-npu is kept out of the test environment
        (("+recipe=llama7b",), "GiB"),
        (("train.dtype=fp16",), "train.dtype"),
    ],
    ids=["world", "pp>layers", "batch", "tp", "device", "no-cuda", "no-npu", "memory", "dtype"],
)
def test_bad_config_fails_fast_with_one_line(tmp_path, overrides, key):
    run = run_entry("train", tmp_path / "run", *overrides, timeout=60)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(("recipe", "n_params"), [("llama7b", 6_738_415_616), ("llama70b", 68_976_648_192)])
def test_recipes_compose_real_shapes_without_allocating(recipe, n_params):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+recipe={recipe}"])
    model = ModelConfig(**cfg.model)
    assert LLAMA.param_count(model) == n_params
    params = LLAMA.init_params(model, 0, device="meta")
    assert all(t.is_meta for t in params.values())
    assert sum(math.prod(t.shape) for t in params.values()) == n_params
    assert cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.tp == cfg.launcher.nnodes * cfg.launcher.nproc_per_node


@pytest.mark.full
def test_multirun_writes_one_dir_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable, "-m", "chameleon.train", "--multirun", f"hydra.sweep.dir={sweep}", "output.progress=false",
        "launcher.nproc_per_node=1", *SMALL_RUN[1:], "train.steps=2", "train.lr=0.001,0.002",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summaries = sorted(sweep.glob("*/summary.json"))
    assert [p.parent.name for p in summaries] == ["0", "1"]
    losses = [json.loads(p.read_text())["losses"] for p in summaries]
    assert losses[0][0] == losses[1][0] and losses[0][1] != losses[1][1]  # same init, different lr
