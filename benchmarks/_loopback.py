"""Several "hosts" on one machine: a job's nodes on their own loopback addresses, reached only over TCP.

Node ``k`` binds its process groups to ``127.0.0.(k+1)``; nodes other than 0 are agent processes started in
sessions of their own, exactly as ``python -m chameleon.train ... launcher.node_rank=K`` would run on a host.
Shared by the multi-node tests and benchmarks.
"""

from __future__ import annotations

import random
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the store, and the port node agents reach the controller on).

    Drawn below the kernel's ephemeral range: a port from bind(0) is one the kernel hands out again, to the next
    bind(0) or to any connection's own end, before the job gets to listen on it (EADDRINUSE on a busy host).
    """
    low = _ephemeral_low()
    while True:
        port = random.randrange(max(1024, low - 12000), low - 1)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class Loopback:
    """One job over ``nnodes`` loopback nodes (see the module doc).

    Args:
        workdir: where agents' logs go.
        overrides: the job's Hydra overrides, the same on every node.
        env: the environment (a fresh ``CHAMELEON_SECRET`` is added).
    """

    def __init__(self, workdir: Path, overrides: list[str], *, nnodes: int = 3, env: dict):
        self.workdir, self.nnodes, self.port = Path(workdir), nnodes, free_port_pair()
        self.env = {**env, "CHAMELEON_SECRET": secrets.token_hex(16)}
        self.common = [f"launcher.nnodes={nnodes}", "launcher.master_addr=127.0.0.1", f"launcher.master_port={self.port}",
                       *overrides]
        self.agents: list[subprocess.Popen] = []

    @property
    def control_port(self) -> int:
        return self.port + 1

    def start_agent(self, node: int) -> subprocess.Popen:
        """Start node ``node``'s agent (again, after it died: a node that comes back)."""
        log = open(self.workdir / f"agent{node}-{len(self.agents)}.log", "w")  # noqa: SIM115 - the process owns it
        cmd = [sys.executable, "-m", "chameleon.train", *self.common, f"launcher.node_rank={node}",
               f"launcher.node_addr=127.0.0.{node + 1}"]
        agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
                                 start_new_session=True)
        self.agents.append(agent)
        return agent

    def run(self, node0: Callable[[list[str], dict], Any], *, restart: int | None = None,
            during: Callable[[Loopback], None] | None = None, agent_timeout_s: float = 30.0) -> Any:
        """Start every agent, run node 0 with ``node0(overrides, env)``; ``restart`` a node's agent as soon as its
        first one dies; call ``during(self)`` meanwhile. Returns node 0's result once every agent exited."""
        first = {node: self.start_agent(node) for node in range(1, self.nnodes)}
        helpers = []
        if restart is not None:
            helpers.append(threading.Thread(target=lambda: (first[restart].wait(), self.start_agent(restart))))
        if during is not None:
            helpers.append(threading.Thread(target=during, args=(self,)))
        for h in helpers:
            h.daemon = True
            h.start()
        result = node0([*self.common, "launcher.node_rank=0"], self.env)
        for agent in self.agents:
            try:
                agent.wait(timeout=agent_timeout_s)
            except subprocess.TimeoutExpired:
                agent.kill()
                raise RuntimeError(f"an agent ({' '.join(agent.args[-2:])}) did not exit after the job ended") from None
        return result

    def log(self, node: int) -> str:
        """Everything node ``node``'s agents printed."""
        return "".join(p.read_text() for p in sorted(self.workdir.glob(f"agent{node}-*.log")))
