"""The controller's own death, Ctrl-C and SIGTERM: workers leave quietly, checkpoints stay whole, runs resume.

Each run trains the same job (4 workers, dp2 × pp2); the resumed runs end with the
losses and parameters of that job's failure-free run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ENV, Run, lingering, run_entry

from benchmarks._loopback import free_port_pair
from benchmarks._processes import session_processes
from chameleon.faults.inject import rot
from chameleon.model.config import ModelConfig
from chameleon.model.llama import param_shapes
from chameleon.report.compare import mismatches
from chameleon.runtime.checkpoint import latest_checkpoint, whole_checkpoint

STEPS = 150
# No straggler verdicts: this job's step 32 is a gradient spike (norm 4.1) where a 1e-5 difference in the parameters
# becomes 1e-3 in the losses after it (one process runs 2.5e-3 from dp2 × pp2 by step 33), so the resumed runs meet
# the failure-free one only on its layout. On a busy CI host a healthy device was once found slow at step 7, and the
# plan Eq. 8 moved to (evict, as reproduced with a slow fault) ran 1.2e-3 from it after step 32, nothing lost.
JOB = (f"train.steps={STEPS}", "model.dim=64", "model.n_layers=4", "train.global_batch=8", "train.micro_batch=2",
       "train.seq_len=32", "launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2", "failure=none",
       "ft.slow=off")
SHAPES = param_shapes(ModelConfig(dim=64, n_layers=4))


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory) -> Run:
    run = run_entry("train", tmp_path_factory.mktemp("ff") / "run", *JOB)
    assert run.returncode == 0, run.stderr
    return run


def start(run_dir: Path, *overrides: str, env: dict = ENV) -> subprocess.Popen:
    """The job, in a session of its own, with the signals these tests send at their defaults in it (a child of a
    background job inherits SIGINT ignored, as POSIX has it, and would train on through a Ctrl-C)."""
    cmd = [sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", "output.progress=false", *JOB, *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=run_dir.parent, start_new_session=True, preexec_fn=_default_signals)


def _default_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until ``path`` holds ``text`` (the run reached that point)."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never held {text!r}"
        time.sleep(0.05)


def resume_and_compare(tmp_path: Path, root: Path, failure_free: Run, *overrides: str, env: dict = ENV) -> Run:
    """Resume the job from ``root`` (with ``overrides``, in ``env``): from its newest whole checkpoint, to the
    failure-free run's losses."""
    info, _ = whole_checkpoint(root, SHAPES)  # every file whole, the model's own tensors
    run = run_entry("train", tmp_path / "resumed", *JOB, f"ckpt.resume={root}", *overrides, env=env)
    assert f"resuming from {info.path}" in run.stderr
    assert run.returncode == 0, run.stderr
    got, ref = run.summary, failure_free.summary
    assert got["first_step"] == info.committed_steps
    ref_tail = {**ref, "steps_completed": got["steps_completed"], "losses": ref["losses"][got["first_step"]:],
                "sample_ids_digest": got["sample_ids_digest"],
                "val_losses": [v for v in ref["val_losses"] if v[0] >= got["first_step"]]}
    assert not mismatches(got, run.params, ref_tail, failure_free.params)
    assert not run.leftover_workers()
    return run


@pytest.mark.full
def test_controller_killed_workers_leave_quietly_and_the_checkpoint_resumes(tmp_path, failure_free):
    proc = start(tmp_path / "run", "ckpt.interval=10")
    wait_for(tmp_path / "run" / "events.jsonl", '"checkpoint", "step": 20', proc)
    proc.send_signal(signal.SIGKILL)  # the controller only: its workers must notice and leave
    _, err = proc.communicate()  # returns once every worker closed its stderr, i.e. exited
    assert not lingering(proc.pid, grace_s=2.0), "workers outlived the controller by more than a moment"
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) <= 4 and all("chameleon worker" in x and "exiting" in x for x in lines), err
    resume_and_compare(tmp_path, tmp_path / "run" / "checkpoints", failure_free)


@pytest.mark.full
def test_sigterm_saves_a_checkpoint_at_the_next_step_boundary_then_exits_4(tmp_path, failure_free):
    proc = start(tmp_path / "run", "ckpt=none")  # no periodic checkpoints: SIGTERM still saves one
    wait_for(tmp_path / "run" / "metrics.jsonl", '"step": 30', proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err
    root = tmp_path / "run" / "checkpoints"
    assert f"ckpt.resume={root}" in err.strip().splitlines()[-1]
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]
    committed = len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    assert saved == [committed], "one checkpoint, of the last committed step"
    assert not lingering(proc.pid)
    got = resume_and_compare(tmp_path, root, failure_free).summary
    assert got["first_step"] == committed


def interrupt(proc: subprocess.Popen, says: str) -> tuple[str, set[int]]:
    """Ctrl-C to ``proc``'s whole process group, as a terminal sends it; its stderr, and the processes of its
    session other than itself still alive when it printed a line starting with ``says``."""
    os.killpg(proc.pid, signal.SIGINT)
    err, others = "", None
    for line in proc.stderr:  # until the run closes it
        err += line
        if line.startswith(says):
            others = set(session_processes(proc.pid)) - {proc.pid}
    return err, others


def test_ctrl_c_stops_every_process_with_one_line(tmp_path):
    """Started from a background job (SIGINT ignored in the test process meanwhile), Ctrl-C still stops the run;
    when the line says every worker is stopped, no process of the run but the controller itself is left."""
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = start(tmp_path / "run")
    finally:
        signal.signal(signal.SIGINT, ignored)
    wait_for(tmp_path / "run" / "metrics.jsonl", '"step": 5', proc)
    err, others = interrupt(proc, "chameleon: interrupted")
    assert proc.wait(timeout=60) == 130
    assert err.strip().splitlines()[-1] == "chameleon: interrupted (Ctrl-C); every worker is stopped"
    assert others == set(), "processes of the run outlived the line that says they are stopped"
    assert "Traceback" not in err
    assert not lingering(proc.pid)
    assert not (tmp_path / "run" / "summary.json").exists()



@pytest.mark.full
def test_ctrl_c_to_a_node_agent_stops_its_workers_before_it_says_so(tmp_path):
    """Node 1's agent is interrupted mid-run: its workers are gone when it says so; the job goes on without them."""
    nodes = ("launcher.nnodes=2", "launcher.nproc_per_node=2", "launcher.master_addr=127.0.0.1",
             f"launcher.master_port={free_port_pair()}")
    env = {**ENV, "CHAMELEON_SECRET": "s"}
    agent = start(tmp_path / "agent", *nodes, "launcher.node_rank=1", "launcher.node_addr=127.0.0.2", env=env)
    node0 = start(tmp_path / "run", *nodes, "launcher.node_rank=0", env=env)
    wait_for(tmp_path / "run" / "metrics.jsonl", '"step": 5', node0)
    err, others = interrupt(agent, "chameleon agent 1: interrupted")
    assert agent.wait(timeout=60) == 130
    assert err.strip().splitlines()[-1] == "chameleon agent 1: interrupted; its workers are stopped"
    assert others == set(), "processes of the agent outlived the line that says they are stopped"
    _, err = node0.communicate(timeout=120)
    assert node0.returncode == 0 and "node 1 lost" in err, err


@pytest.mark.full
def test_node_0_killed_every_other_node_exits_3_and_a_relaunch_resumes(tmp_path, failure_free):
    """Node 0's whole process group is SIGKILLed mid-run (the controller and its workers): node 1's agent was never
    told how the job ended, so it stops its workers and exits 3 within its lease, saying to relaunch with the
    checkpoint root; the relaunch of both nodes from that root ends at the failure-free losses. (It exits 0.7 s
    after the kill on a quiet host: a 4 s lease keeps the bound a bound on a loaded one.)"""
    lease_s = 4.0  # ft.heartbeat_timeout_s: a node's lease
    def nodes(node: int) -> tuple[str, ...]:
        return ("launcher.nnodes=2", "launcher.nproc_per_node=2", "launcher.master_addr=127.0.0.1",
                f"launcher.master_port={port}", f"launcher.node_rank={node}", f"launcher.node_addr=127.0.0.{node + 1}",
                f"ft.heartbeat_timeout_s={lease_s}")

    port, env = free_port_pair(), {**ENV, "CHAMELEON_SECRET": "s"}
    agent = start(tmp_path / "agent", *nodes(1), "ckpt.interval=10", env=env)
    node0 = start(tmp_path / "run", *nodes(0), "ckpt.interval=10", env=env)
    wait_for(tmp_path / "run" / "events.jsonl", '"checkpoint", "step": 20', node0)
    os.killpg(node0.pid, signal.SIGKILL)
    killed = time.monotonic()
    _, err = agent.communicate(timeout=60)
    took = time.monotonic() - killed
    node0.communicate()
    root = tmp_path / "run" / "checkpoints"
    assert agent.returncode == 3, err
    assert err.strip().splitlines()[-1].startswith("chameleon agent 1: lost the controller before it said the job "
                                                  "ended"), err
    assert err.strip().splitlines()[-1].endswith(f"relaunch the job on every node with ckpt.resume={root} to "
                                                 "continue from its newest checkpoint"), err
    assert took < lease_s, f"node 1 exited {took:.1f} s after node 0 died, past its {lease_s} s lease"
    assert not lingering(agent.pid) and not lingering(node0.pid)

    port = free_port_pair()
    resumed_agent = start(tmp_path / "agent", *nodes(1), f"ckpt.resume={root}", env=env)
    resume_and_compare(tmp_path, root, failure_free, *nodes(0), env=env)
    assert resumed_agent.wait(timeout=60) == 0
    assert not lingering(resumed_agent.pid)


@pytest.mark.full
def test_a_resume_passes_over_a_damaged_newest_checkpoint_with_one_line(tmp_path, failure_free):
    """64 bytes in the middle of one shard of the newest checkpoint overwritten, its COMPLETE marker left in place
    (bit rot, a bad copy): the resume names the file, starts from the checkpoint before it, and ends at the
    failure-free losses."""
    root = tmp_path / "checkpoints"
    shutil.copytree(failure_free.run_dir / "checkpoints", root)
    newest = latest_checkpoint(root)
    assert newest.step == STEPS
    shard = max(newest.path.glob("*.pt"), key=lambda p: p.stat().st_size)
    rot(shard)
    older = whole_checkpoint(root, SHAPES)[0]
    assert older.step < STEPS and latest_checkpoint(root).step == STEPS  # its COMPLETE marker is still there
    run = resume_and_compare(tmp_path, root, failure_free)
    assert run.summary["first_step"] == older.committed_steps
    said = [x for x in run.stderr.splitlines() if "resuming from" in x]
    assert len(said) == 1 and said[0].startswith(
        f"chameleon: resuming from {older.path} ({older.committed_steps} committed steps), the newest whole "
        f"checkpoint: {shard} is damaged: its "), said
