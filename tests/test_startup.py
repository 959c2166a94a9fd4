"""A start that cannot work ends in one line naming the key and the fix, with exit code 2, within seconds; an agent
whose controller refuses it or is gone says which, and never exits 0 unless the controller said the job trained.

What a host can see for itself (a port taken, an address not its own, no secret) ends node 0 or an agent before
anything starts or is written; what only the controller can tell (another secret, a store the agent cannot reach)
ends the agent within seconds of reaching it. Real processes on real ports: 127.0.0.2 is an address of this host,
192.0.2.1 (TEST-NET-1, reserved for documentation) is no host's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ENV, lingering

from benchmarks._loopback import free_port_pair
from chameleon import cli, train
from chameleon.config import to_config
from chameleon.runtime.node.preflight import check_job
from chameleon.runtime.node.wire import Listener, connect, job_key
from chameleon.runtime.protocol.errors import LaunchError

# A start's imports and its forkserver take 3-10 s on this 2-core host (21 s seen at load 17); a node that waits
# instead of saying waits launcher.join_timeout_s, 120 s, so waiting cannot pass for saying.
SAID_WITHIN_S = 45.0
NOT_HERE = "192.0.2.1"
JOB = ("model.dim=64", "model.n_layers=4", "train.global_batch=8", "train.micro_batch=2", "train.seq_len=32",
       "launcher.nproc_per_node=2", "parallel.dp=2", "parallel.pp=2", "failure=none", "ckpt=none",
       "output.progress=false", "report.plots=false", "launcher.nnodes=2", "launcher.master_addr=127.0.0.1")
NO_SECRET = {k: v for k, v in ENV.items() if k != "CHAMELEON_SECRET"}
SECRET = {**NO_SECRET, "CHAMELEON_SECRET": "the job's secret"}


def launch(workdir: Path, node: int, port: int, *overrides: str, env: dict = SECRET, join_timeout_s: float = 120,
           stderr=subprocess.PIPE) -> subprocess.Popen:
    """Node ``node`` of a two-node loopback job whose node 0 listens on ``port`` (and ``port + 1``)."""
    where = (f"hydra.run.dir={workdir / 'run'}",) if node == 0 else (f"launcher.node_addr=127.0.0.{node + 1}",)
    cmd = [sys.executable, "-m", "chameleon.train", *JOB, f"launcher.master_port={port}", f"launcher.node_rank={node}",
           f"launcher.join_timeout_s={join_timeout_s}", *where, *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=workdir,
                            start_new_session=True)


def outcome(proc: subprocess.Popen, started: float) -> tuple[int, list[str], float]:
    """Exit code, stderr lines and seconds from ``started`` to the exit (which must come within 150 s)."""
    try:
        _, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{' '.join(proc.args[-3:])} said nothing and did not end within 150 s") from None
    return proc.returncode, err.strip().splitlines(), time.monotonic() - started


def node_0(workdir: Path, port: int, **kw) -> subprocess.Popen:
    """Node 0, once it listens for agents."""
    proc = launch(workdir, 0, port, **kw)
    deadline = time.monotonic() + 60
    while not _listening(port + 1):
        assert proc.poll() is None and time.monotonic() < deadline, "node 0 never listened"
        time.sleep(0.1)
    return proc


def _listening(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.mark.parametrize(("node", "hold", "overrides", "env", "said"), [
    (0, 0, (), SECRET, "launcher.master_port={port} cannot be listened on here (Address already in use"),
    (0, 1, (), SECRET, "launcher.control_port={control} cannot be listened on here (Address already in use"),
    (0, None, (f"launcher.master_addr={NOT_HERE}",), SECRET,
     f"launcher.master_addr={NOT_HERE} is not an address of this host, and node 0"),
    (1, None, (f"launcher.node_addr={NOT_HERE}",), SECRET, f"launcher.node_addr={NOT_HERE} is not an address of this host"),
    (1, None, ("launcher.master_addr=nohost.invalid",), SECRET, "launcher.master_addr=nohost.invalid does not resolve"),
    (1, None, (), NO_SECRET, "a multi-node job needs CHAMELEON_SECRET set to the same secret on every node"),
], ids=["master port taken", "control port taken", "master_addr not here", "node_addr not here", "no such host",
        "no secret"])
def test_a_host_that_cannot_be_this_node_says_so_before_starting(tmp_path, node, hold, overrides, env, said):
    port = free_port_pair()
    taken = socket.create_server(("127.0.0.1", port + hold)) if hold is not None else None
    try:
        code, lines, took = outcome(launch(tmp_path, node, port, *overrides, env=env), time.monotonic())
    finally:
        if taken is not None:
            taken.close()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("chameleon: launch error: ") and said.format(port=port, control=port + 1) in lines[0]
    assert took < SAID_WITHIN_S
    assert not (tmp_path / "run").exists(), "nothing is written"


def test_a_port_taken_after_the_check_is_the_same_one_line(tmp_path, monkeypatch):
    """Taken between the launch check and the controller's start: the controller's own bind says the same."""
    from chameleon.runtime.control.controller import Controller

    monkeypatch.setenv("CHAMELEON_SECRET", "s")
    port = free_port_pair()
    cfg = cli.compose_command_line([*JOB, f"launcher.master_port={port}", "launcher.node_rank=0"])
    train._prepare(cfg)  # free now
    job = to_config(cfg)
    with socket.create_server(("127.0.0.1", port)), pytest.raises(LaunchError) as err:
        Controller(job, plan=check_job(cfg), run_dir=tmp_path, secret="s")
    assert str(err.value).startswith(f"launcher.master_port={port} cannot be listened on here (Address already in use")


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    """Node 0 of a two-node job, listening and waiting for node 1; its port and its stderr's file."""
    workdir, port = tmp_path_factory.mktemp("node0"), free_port_pair()
    log = workdir / "node0.log"
    with log.open("w") as stderr:
        proc = node_0(workdir, port, join_timeout_s=600, stderr=stderr)
    yield port, log
    assert proc.poll() is None, log.read_text()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def test_an_agent_with_another_secret_is_refused_within_seconds(tmp_path, controller):
    port, log = controller
    started = time.monotonic()
    code, lines, took = outcome(launch(tmp_path, 1, port, env={**SECRET, "CHAMELEON_SECRET": "another"}), started)
    assert code == 2 and len(lines) == 2, lines
    assert lines[1] == (f"chameleon agent 1: refused: the controller at 127.0.0.1:{port + 1} did not accept our proof of "
                        "the secret: set the same CHAMELEON_SECRET on every node")
    assert took < SAID_WITHIN_S
    deadline = time.monotonic() + 10
    while "does not hold this job's secret" not in log.read_text():  # node 0 logs the refusal and waits on
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_an_agent_that_cannot_reach_the_store_says_so_within_seconds(tmp_path, controller):
    """Its control link reaches node 0, the store port does not (here: nothing listens on the port it was given)."""
    port, _ = controller
    elsewhere = free_port_pair()
    started = time.monotonic()
    code, lines, took = outcome(launch(tmp_path, 1, elsewhere, f"launcher.control_port={port + 1}"), started)
    assert code == 2 and len(lines) == 2, lines
    assert lines[1] == (f"chameleon agent 1: node 0's c10d store at 127.0.0.1:{elsewhere} cannot be reached from this "
                        "host (Connection refused), though its control link can: let this host reach node 0 on "
                        "launcher.master_port")
    assert took < SAID_WITHIN_S


def test_an_agent_with_another_config_is_refused_and_node_0_stops(tmp_path):
    """A mistake in how the job was launched: both ends name the keys that differ, within seconds of meeting."""
    port = free_port_pair()
    node0 = node_0(tmp_path, port)
    code, lines, took = outcome(launch(tmp_path, 1, port, "train.steps=7"), time.monotonic())
    why = "its config differs from node 0's in train.steps: run the same command on every node"
    assert code == 2 and lines[1:] == [f"chameleon agent 1: not admitted: {why}"], lines
    assert took < SAID_WITHIN_S
    code, lines, _ = outcome(node0, time.monotonic())
    assert code == 2 and lines[-1] == f"chameleon: launch error: node 1 at 127.0.0.2: {why}", lines


def test_node_0_whose_nodes_never_come_says_which_and_exits_2(tmp_path):
    code, lines, took = outcome(launch(tmp_path, 0, free_port_pair(), join_timeout_s=1), time.monotonic())
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("chameleon: launch error: nodes [1] did not join within launcher.join_timeout_s=1 s")
    assert took < SAID_WITHIN_S


@pytest.mark.full  # a whole job over two nodes; test_a_closed_listener_refuses_at_once is the fast tier's
def test_an_agent_that_missed_the_end_of_the_job_asks_for_a_relaunch(tmp_path):
    """Node 1's agent is stopped (a partition) while the job finishes without it; resumed, it fences, registers
    again and finds nothing listening where its controller was. It was never told how the job ended, so it says
    to relaunch and exits 3 (ft.on_fault=exit's code), never 0: under Slurm or Kubernetes 0 means done."""
    port = free_port_pair()
    agent = launch(tmp_path, 1, port, "train.steps=20")
    node0 = launch(tmp_path, 0, port, "train.steps=20")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"step": 2' in metrics.read_text()):
        assert node0.poll() is None and time.monotonic() < deadline, node0.communicate()[1]
        time.sleep(0.05)
    os.kill(agent.pid, signal.SIGSTOP)
    _, err = node0.communicate(timeout=120)
    assert node0.returncode == 0 and "node 1 lost" in err, err
    started = time.monotonic()
    os.kill(agent.pid, signal.SIGCONT)
    code, lines, took = outcome(agent, started)
    assert code == 3, lines
    assert lines[-1] == (f"chameleon agent 1: lost the controller before it said the job ended (nothing answers at "
                         f"127.0.0.1:{port + 1}): relaunch the job on every node from its start (it saves no "
                         "checkpoints: ckpt.interval=0)")
    assert took < 10.0
    assert not lingering(agent.pid)


def test_a_closed_listener_refuses_at_once():
    """Once the job has ended, a late agent is refused, not half-admitted by an accept() still pending."""
    key = job_key("s")
    listener = Listener("127.0.0.1", 0, key)
    first = connect("127.0.0.1", listener.port, key)  # its accepting thread is back in accept() after this
    listener.close()
    first.close()
    with pytest.raises(ConnectionRefusedError):
        connect("127.0.0.1", listener.port, key)


def test_a_link_closed_earlier_in_the_same_select_is_passed_over():
    """The controller handles a select's ready links one by one: one node's message can lose, and close, another node
    whose link is still listed as ready (seen at 8,192 emulated devices as a KeyError that ended the job)."""
    import selectors

    from chameleon.runtime.control.controller import Controller
    from chameleon.runtime.node.wire import Link

    ours, theirs = socket.socketpair()
    with ours, theirs:
        link = Link(ours, b"key", mine=b"m", theirs=b"t", peer="node 7")
        controller = Controller.__new__(Controller)  # only the books a ready link is looked up in
        controller.listener, controller.arriving, controller.node_of = None, {}, {}
        theirs.sendall(b"bytes that would be read")
        controller._on_ready(link, selectors.EVENT_READ | selectors.EVENT_WRITE)
        assert ours.recv(64) == b"bytes that would be read"  # nothing was read from the closed node's link
