"""Where a job's nodes meet: torchrun-style launch keys, filled from the environment where not given.

``launcher.nnodes``, ``node_rank``, ``master_addr`` and ``master_port`` left null are
taken from ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK`` (as torchrun sets them) or,
inside a Slurm job, from ``SLURM_NNODES``, ``SLURM_NODEID`` and the job's first host.
The controller's agent port is ``master_port + 1`` unless ``launcher.control_port``
is given. A multi-node job authenticates its control traffic with the secret in
``CHAMELEON_SECRET``, which every node must share.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

from chameleon.runtime.protocol.errors import LaunchError

DEFAULT_PORT = 29500
SECRET_ENV = "CHAMELEON_SECRET"


def resolve(launcher: Mapping, env: Mapping[str, str] | None = None) -> dict:
    """``launcher`` with every null launch key filled (see the module doc) from ``env`` (None: the process's
    environment as it is now: a library may have replaced ``os.environ`` since import, as ``datasets``' worker
    pool does).

    Raises:
        LaunchError: a value in the environment is malformed.
    """
    env = os.environ if env is None else env
    out = dict(launcher)
    slurm = "SLURM_JOB_ID" in env
    if out["nnodes"] is None:
        out["nnodes"] = _int(env, "SLURM_NNODES") if slurm and "SLURM_NNODES" in env else 1
    if out["node_rank"] is None:
        out["node_rank"] = next((_int(env, k) for k in ("NODE_RANK", "SLURM_NODEID") if k in env), 0)
    multi = out["nnodes"] > 1
    if out["master_addr"] is None:
        out["master_addr"] = env.get("MASTER_ADDR") or (_slurm_first_host(env) if slurm and multi else None)
        out["master_addr"] = out["master_addr"] or (None if multi else "127.0.0.1")
    if out["master_port"] is None:
        out["master_port"] = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT if multi else 0
    if out["control_port"] is None and multi:
        out["control_port"] = out["master_port"] + 1
    if out["node_addr"] is None and multi and out["master_addr"]:
        out["node_addr"] = _route_to(out["master_addr"])
    return out


def launch_problem(launcher: Mapping) -> str | None:
    """What keeps resolved launch keys from describing a job (naming the key and the fix), or None."""
    nnodes = launcher["nnodes"]
    if not 0 <= launcher["node_rank"] < nnodes:
        return f"launcher.node_rank={launcher['node_rank']} is not a node of launcher.nnodes={nnodes}: use 0..{nnodes - 1}"
    if nnodes > 1 and not launcher["master_addr"]:
        return "launcher.master_addr is not set (nor MASTER_ADDR): give node 0's address on every node"
    if nnodes > 1 and not launcher["master_port"]:
        return "launcher.master_port=0 picks a free port, which other nodes cannot know: give a fixed port"
    return None


def job_secret(nnodes: int, env: Mapping[str, str] | None = None) -> str:
    """The secret that authenticates control traffic: ``CHAMELEON_SECRET`` (of ``env``; None: the process's
    environment now), or a fresh one on one node.

    Raises:
        LaunchError: a multi-node job without ``CHAMELEON_SECRET``.
    """
    secret = (os.environ if env is None else env).get(SECRET_ENV)
    if secret:
        return secret
    if nnodes > 1:
        raise LaunchError(f"a multi-node job needs {SECRET_ENV} set to the same secret on every node, e.g. "
                          f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')")
    return secrets.token_hex(16)


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise LaunchError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _slurm_first_host(env: Mapping[str, str]) -> str | None:
    """The first host of the Slurm job (node 0), as ``scontrol show hostnames`` expands the node list."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist or shutil.which("scontrol") is None:
        return None
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    hosts = out.stdout.split()
    return hosts[0] if hosts else None


def _route_to(host: str) -> str:
    """This host's address on the route to ``host`` (what the other nodes can reach us at)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))  # no packet is sent: this only selects the route
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def host_identity() -> str:
    """This machine (not this address): its hostname and boot id, equal for every loopback node of one host."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
