"""Every entry point answers nonsense with one line naming the key and the fix (exit 2), and destroys nothing.

Most cases run the entry points' own checks in-process on the composed command line (what the CLI does before
Hydra runs anything); a few run the real commands to check the one line, the exit code and what is on disk.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ENV, SMALL_RUN, run_entry
from hydra.errors import HydraException

from chameleon import cli, plan, simulate, train
from chameleon.config import ConfigError

CHECKS = {"train": train._prepare, "plan": plan.check, "simulate": simulate.check}


def refusal(entry: str, *overrides: str) -> str:
    """The one line an entry point refuses ``overrides`` with (it must refuse them)."""
    with pytest.raises((ConfigError, HydraException, ValueError)) as err:
        CHECKS[entry](cli.compose_command_line(list(overrides)))
    return cli.one_line(err.value)


@pytest.mark.parametrize(("overrides", "expected"), [
    (("+foo=1",), "unknown key foo"),
    (("+train.stpes=2",), "unknown key train.stpes: did you mean train.steps?"),
    (("train.stpes=2",), "Could not override 'train.stpes'"),
    (("+recipe=nope",), "Could not find 'recipe/nope'"),
    (("failure.rank=99",), "failure.rank=99 is not a worker (0..3)"),
    (("failure=schedule", "failure.faults=[]"), "empty failure.faults"),
    (("failure=stall", "failure.phase=any"), "pin it to a phase"),
    (("failure=node_kill",), "needs several nodes"),
    (("failure=random", "failure.kinds=[error]"), "failure.kinds"),
    (("ft.stall_timeout_s=-1",), "ft.stall_timeout_s=-1"),
    (("launcher.node_rank=3",), "launcher.node_rank=3 is not a node of launcher.nnodes=1"),
    (("launcher.nnodes=2", "launcher.nproc_per_node=2"), "launcher.master_addr is not set"),
    (("launcher.nnodes=2", "launcher.nproc_per_node=2", "launcher.master_addr=h", "launcher.master_port=0"),
     "launcher.master_port=0"),
    (("data.path=/nonexistent/corpus.txt",), "data.path='/nonexistent/corpus.txt' is not a file"),
    (("data.pack=zigzag",), "data.pack='zigzag': use window, document"),
    (("train.steps=abc",), "train.steps='abc': give an integer"),
    (("train.compile=maybe",), "train.compile='maybe': give true or false"),
    (("train.bucket_mb=0",), "train.bucket_mb=0.0: must be > 0"),
    (("data.val_fraction=1",), "data.val_fraction=1.0: use a fraction in [0, 1)"),
    (("train.eval_batches=1000",), "train.eval_batches=1000 evaluates 16000 windows but the validation documents hold"),
    (("train.eval_interval=-1",), "train.eval_interval=-1"),
    (("data.val_fraction=0",), "train.eval_interval=25 needs validation documents"),
    (("ckpt.resume=/nonexistent",), "ckpt.resume=/nonexistent is not a directory"),
    (("ckpt.keep=0",), "ckpt.keep=0"),
    (("hydra.run.dir=/etc/passwd/run",), "cannot be created or written"),
], ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_train_refuses(overrides, expected):
    assert expected in refusal("train", *overrides)


@pytest.mark.parametrize(("overrides", "expected"), [
    (("plan.failed=[999]",), "plan.failed names [999], which are not devices of the plan (0..3)"),
    (("plan.failed=[-1]",), "names [-1]"),
    (("plan.failed=[]",), "plan.failed is empty"),
    (("plan.failed=[0,1,2,3]",), "names every device"),
    (("plan.failed=[1,1]",), "names a device twice"),
    (("plan.checkpoint_age_s=-5",), "plan.checkpoint_age_s=-5"),
    (("policy.name=magic",), "policy.name='magic'"),
    (("parallel.pp=-3",), "parallel.pp=-3: must be ≥ 1"),
])
def test_plan_refuses(overrides, expected):
    assert expected in refusal("plan", *overrides)


def test_simulate_refuses(tmp_path):
    malformed, stray = tmp_path / "malformed.csv", tmp_path / "stray.csv"
    malformed.write_text("0,remove,node1\nthis is not a trace line\n")
    stray.write_text("1000,remove,node99\n")
    assert "trace=csv needs trace.path" in refusal("simulate", "trace=csv")
    assert "is not a file" in refusal("simulate", "trace=csv", f"trace.path={tmp_path / 'none.csv'}")
    assert f"{malformed}:2" in refusal("simulate", "trace=csv", f"trace.path={malformed}")
    assert "names node99" in refusal("simulate", "trace=csv", f"trace.path={stray}")
    assert "trace.interval_s=-5.0" in refusal("simulate", "trace=oobleck", "trace.interval_s=-5")
    assert "sim.horizon_h" in refusal("simulate", "sim.horizon_h=0")
    assert "sim.policies[0]='magic': use chameleon, oracle," in refusal("simulate", "sim.policies=[magic]")
    assert "cluster.n_devices=8" in refusal("simulate", "sim.initial=recipe", "cluster.n_devices=8")  # 4 devices on 8


@pytest.mark.parametrize("entry", ["train", "plan", "simulate"])
@pytest.mark.parametrize("override", ["train.global_batch=-3", "train.micro_batch=0", "train.seq_len=-1"])
def test_every_entry_point_refuses_a_batch_it_cannot_plan_in_one_line(entry, override):
    """The batch each entry point plans with is checked by each (simulate raised a traceback on a negative one)."""
    key, value = override.split("=")
    assert f"{key}={value}: must be ≥ 1" in refusal(entry, override)


@pytest.mark.parametrize("content", [b"\x00\x01\x02binary" * 100, "caf\u00e9".encode("latin-1") * 100, b"tiny"],
                         ids=["binary", "latin-1", "too short"])
def test_train_refuses_data_it_cannot_read(tmp_path, content):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    assert f"data.path='{path}'" in refusal("train", f"data.path={path}")


def test_a_text_of_one_paragraph_has_no_validation_documents(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("hello world " * 50)
    assert "set train.eval_interval=0" in refusal("train", f"data.path={path}")
    CHECKS["train"](cli.compose_command_line([f"data.path={path}", "train.eval_interval=0"]))  # accepted


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A run's checkpoint root with a complete checkpoint (single process, the small model)."""
    run = run_entry("train", tmp_path_factory.mktemp("ck") / "run", *SMALL_RUN, "launcher.nproc_per_node=1",
                    "ckpt.interval=2", "train.steps=2")
    assert run.returncode == 0, run.stderr
    return run.run_dir / "checkpoints"


def damaged(checkpoint: Path, tmp_path: Path, damage) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoint, root)
    step = sorted(root.glob("step_*"))[-1]
    damage(step)
    return root


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda step: _truncate(next(step.glob("*.pt"))), "is missing or damaged"),
    (lambda step: _truncate(step / "metadata.json"), "metadata.json is unreadable"),
    (lambda step: next(step.glob("*.pt")).unlink(), "is missing or damaged"),
], ids=["truncated shard", "truncated metadata", "missing shard"])
def test_resume_refuses_a_damaged_checkpoint(tmp_path, checkpoint, damage, expected):
    root = damaged(checkpoint, tmp_path, damage)
    assert expected in refusal("train", *SMALL_RUN, "launcher.nproc_per_node=1", f"ckpt.resume={root}")


def test_resume_refuses_another_models_checkpoint(checkpoint):
    line = refusal("train", *SMALL_RUN, "launcher.nproc_per_node=1", "model.dim=32", f"ckpt.resume={checkpoint}")
    assert "belongs to another model" in line and "resume with the model it was saved with" in line


@pytest.mark.full  # over 5 s: the full suite
def test_refused_commands_end_in_one_line_and_touch_no_earlier_run(tmp_path, checkpoint):
    """Real commands: exit 2, one line, no traceback; a finished run's directory is left as it was."""
    finished = checkpoint.parent
    before = {p: p.read_bytes() for p in finished.rglob("*") if p.is_file()}
    for overrides in ((f"hydra.run.dir={finished}",), ("+train.stpes=2",),
                      (f"ckpt.resume={damaged(checkpoint, tmp_path, lambda s: _truncate(s / 'metadata.json'))}",)):
        proc = subprocess.run([sys.executable, "-m", "chameleon.train", *SMALL_RUN, "launcher.nproc_per_node=1",
                               *overrides], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("chameleon: config error:"), proc.stderr
    assert {p: p.read_bytes() for p in finished.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "outputs").exists(), "a refused command writes no run directory"
    proc = subprocess.run([sys.executable, "-m", "chameleon.plan", "plan.failed=[999]"], capture_output=True, text=True,
                          env=ENV, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("entry", ["train", "plan", "simulate"])
def test_each_entry_point_has_its_own_help(entry):
    proc = subprocess.run([sys.executable, "-m", f"chameleon.{entry}", "--help"], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.startswith(f"usage: python -m chameleon.{entry}")
    assert "Config groups" in proc.stdout and "+recipe=NAME" in proc.stdout


@pytest.mark.full
def test_a_resumed_run_does_not_fire_the_faults_an_earlier_launch_fired(tmp_path):
    """ft.on_fault=exit stops at the kill; the relaunch from its checkpoint says so and trains to the end."""
    common = (*SMALL_RUN, "launcher.nproc_per_node=2", "ckpt.interval=2", "train.steps=6", "failure=kill",
              "failure.rank=1", "failure.step=3", "failure.phase=forward")
    first = run_entry("train", tmp_path / "first", *common, "ft.on_fault=exit")
    assert first.returncode == 3 and "relaunch with ckpt.resume=" in first.stderr
    root = tmp_path / "first" / "checkpoints"
    assert json.loads((root / "faults_fired.json").read_text())["fired"][0]["rank"] == 1
    second = run_entry("train", tmp_path / "second", *common, "ft.on_fault=exit", f"ckpt.resume={root}")
    assert second.returncode == 0, second.stderr
    assert f"resuming from {root}" in second.stderr and second.summary["recoveries"] == []
    assert torch.load(second.run_dir / "final_params.pt", weights_only=True)


def test_a_corrupt_fault_is_typed_as_a_user_writes_it():
    """Hydra reads nan and inf as floats: failure.value takes them as written; nonsense is refused in one line."""
    corrupt = ("failure=corrupt", "failure.target=param", "failure.phase=optimizer")
    for value in ("nan", "inf", "flip"):
        CHECKS["train"](cli.compose_command_line([*corrupt, f"failure.value={value}"]))  # accepted
    CHECKS["train"](cli.compose_command_line(["failure=schedule", "failure.faults=[{kind:corrupt,rank:1,step:2,"
                                                                  "phase:backward,value:inf}]"]))
    assert "failure.value=zero: use one of nan, inf, flip" in refusal("train", *corrupt, "failure.value=zero")
    assert "set failure.phase=backward" in refusal("train", "failure=corrupt", "failure.phase=forward")
    assert "use value=flip" in refusal("train", "failure=corrupt", "failure.target=checkpoint",
                                       "failure.phase=optimizer")


def test_a_slow_fault_with_nonsense_values_is_refused_in_one_line():
    CHECKS["train"](cli.compose_command_line(["failure=slow", "failure.factor=2.5", "failure.duration_s=30"]))  # accepted
    assert "failure.factor=0.5: a slow device computes factor times slower: use a factor > 1" in refusal(
        "train", "failure=slow", "failure.factor=0.5")
    assert "failure.rank=7 is not a worker (0..3)" in refusal("train", "failure=slow", "failure.rank=7")
    assert "ft.slow='sometimes': use on, off" in refusal("train", "ft.slow=sometimes")
    assert "ft.slow_ratio=0.9" in refusal("train", "ft.slow_ratio=0.9")


def test_a_pipeline_of_its_own_tp_size_must_divide_the_heads():
    CHECKS["train"](cli.compose_command_line(["launcher.nproc_per_node=3", "parallel.pipelines=[{layers:[4],"
                                              "micro_batches:2,tp:2},{layers:[4],micro_batches:2}]"]))  # accepted
    assert "parallel.pipelines[0].tp=3 does not divide model.n_heads=4 and model.n_kv_heads=2" in refusal(
        "train", "launcher.nproc_per_node=4", "parallel.pipelines=[{layers:[4],micro_batches:2,tp:3},"
        "{layers:[4],micro_batches:2}]")
