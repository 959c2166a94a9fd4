"""Every command in the README runs as written; the long ones in a short mode (fewer steps, a shorter horizon).

The set-up commands are what CI itself runs; the benchmark commands run in tests/test_benchmarks*.py.
The loopback example runs whole, as the bash script it is, on a free port; the two-host lines on two loopback
addresses; the Slurm line with Slurm's variables as srun sets them.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENV

from benchmarks._loopback import free_port_pair

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
SHORT = {"train": ["train.steps=4", "failure.step=2", "output.progress=false", "report.plots=false"],
         "simulate": ["sim.horizon_h=2", "sim.progress=false", "sim.plots=false"], "plan": []}
REFUSED = {"+recipe=llama7b": 2}  # the README says these are refused here, with one line


def commands(blocks: list[str] = BLOCKS) -> list[list[str]]:
    """Each README command as argv (comments dropped, continued lines joined)."""
    out = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(words)
    return out


OWN_DATA = next(b for b in BLOCKS if "chameleon.prepare" in b)  # its commands run together, on a corpus of the test's
ENTRY_COMMANDS = [c for c in commands() if c[:2] == ["python", "-m"] and "launcher.nnodes=2" not in c
                  and "$JOB" not in c and c not in commands([OWN_DATA])]


def test_every_readme_command_is_covered():
    setup = [c for c in commands() if c[0] in ("python3", "export", "srun", "JOB=") or c[0].startswith("JOB=")]
    benchmarks = [c for c in commands() if c[0] == "python" and c[1].startswith("benchmarks/")]
    loopback = [c for c in commands() if "$JOB" in c or "launcher.nnodes=2" in c]
    own_data = commands([OWN_DATA])
    assert len(setup) + len(benchmarks) + len(loopback) + len(own_data) + len(ENTRY_COMMANDS) == len(commands())
    tested = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name.startswith(
        ("test_benchmarks", "test_control_plane")))
    for c in benchmarks:
        assert Path(c[1]).name in tested, f"{c[1]} is in the README but no test runs it"


@pytest.mark.full
@pytest.mark.parametrize("argv", ENTRY_COMMANDS, ids=lambda c: " ".join(c[2:])[:60])
def test_readme_command_runs(tmp_path, argv):
    entry = argv[2].removeprefix("chameleon.")
    multirun = "--multirun" in argv
    where = f"hydra.sweep.dir={tmp_path / 'sweep'}" if multirun else f"hydra.run.dir={tmp_path / 'run'}"
    cmd = [sys.executable, *argv[1:], where, *SHORT[entry]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    expected = next((code for key, code in REFUSED.items() if key in argv), 0)
    assert proc.returncode == expected, proc.stderr[-3000:]
    if expected:
        assert len(proc.stderr.strip().splitlines()) == 1
    elif entry == "train" and not multirun:
        assert proc.stdout.strip().splitlines()[-1] == str(tmp_path / "run" / "summary.json")


@pytest.mark.full
def test_readme_loopback_example_runs_as_written(tmp_path):
    """Three loopback "hosts": node 1 is killed as a whole in step 20 and the job finishes on the others."""
    block = next(b for b in BLOCKS if "$JOB" in b)
    port = free_port_pair()
    script = block.replace("master_port=29500", f"master_port={port}").replace("python ", f"{sys.executable} ")
    proc = subprocess.run(["bash", "-c", f"set -e\n{script}"], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "devices [2, 3] lost at step 20 (node 1 lost" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1].endswith("summary.json")


@pytest.mark.full
def test_readme_own_data_commands_run_as_written(tmp_path):
    """Prepare a JSONL corpus with a trained BPE, then train on its shards: the default job, its kill included."""
    from chameleon.data.stream import load_corpus

    lines = load_corpus(None).splitlines()
    with (tmp_path / "corpus.jsonl").open("w", encoding="utf-8") as f:
        for i in range(0, len(lines), 20):
            f.write(json.dumps({"text": "\n".join(lines[i:i + 20])}) + "\n")
    script = OWN_DATA.replace("python ", f"{sys.executable} ")
    proc = subprocess.run(["bash", "-c", f"set -e\n{script}"], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())
    assert summary["steps_completed"] == 100 and [r["step"] for r in summary["recoveries"]] == [50]
    assert summary["final_val_loss"] is not None and summary["final_val_loss"] < summary["val_losses"][0][1]


TWO_HOSTS = [c for c in commands() if "launcher.nnodes=2" in c]
SLURM = next(c for c in commands() if c[0] == "srun")


@pytest.mark.full
def test_readme_two_host_lines_run_as_written(tmp_path):
    """Node 0 on 127.0.0.1 (HOST0), node 1 on 127.0.0.2: the default job, its kill included, finishes on both."""
    port = free_port_pair()
    env = {**ENV, "CHAMELEON_SECRET": secrets.token_hex(16)}

    def argv(node: int, extra: list[str]) -> list[str]:
        words = [w.replace("HOST0", "127.0.0.1").replace("master_port=29500", f"master_port={port}")
                 for w in TWO_HOSTS[node]]
        return [sys.executable, *words[1:], f"hydra.run.dir={tmp_path / f'node{node}'}", *SHORT["train"], *extra]

    other = subprocess.Popen(argv(1, ["launcher.node_addr=127.0.0.2"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=tmp_path)
    try:
        head = subprocess.run(argv(0, []), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        _, other_err = other.communicate(timeout=60)
    finally:
        other.kill()
    assert head.returncode == 0 and other.returncode == 0, head.stderr[-3000:] + other_err[-3000:]
    summary = json.loads(Path(head.stdout.strip().splitlines()[-1]).read_text())
    assert summary["steps_completed"] == 4 and [r["step"] for r in summary["recoveries"]] == [2]


@pytest.mark.parametrize("node", [0, 3])
def test_readme_slurm_line_reads_slurms_variables_and_is_refused_here_with_its_memory(tmp_path, node):
    assert SLURM[:3] == ["srun", "--nodes=4", "--ntasks-per-node=1"] and SLURM[3] == "python"
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "4", "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": "localhost",
             "CHAMELEON_SECRET": secrets.token_hex(16)}
    proc = subprocess.run([sys.executable, *SLURM[4:], f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True,
                          text=True, env={**ENV, **slurm}, cwd=tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "over 32 devices" in lines[0] and "GiB" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything is written
