"""Whether this host can be the node it is launched as: checked before anything starts.

Node 0 must own ``launcher.master_addr`` and be able to listen on ``launcher.master_port``
(the c10d store) and ``launcher.control_port`` (the agents' link); every node's
``launcher.node_addr`` must be its own; an agent that has reached the controller must
also reach its store. Each check returns the one line that names the key and the fix,
or None.
"""

from __future__ import annotations

import os
import socket

PROBE_S = 5.0


def node_problem(launcher) -> str | None:
    """What keeps this host from running node ``launcher.node_rank`` (resolved launch keys), or None."""
    master, node_addr, node0 = launcher.master_addr, launcher.node_addr, launcher.node_rank == 0
    try:
        socket.getaddrinfo(master, None)
    except OSError as err:
        return f"launcher.master_addr={master} does not resolve ({_why(err)}): give node 0's host name or IP address"
    if node0 and _listen_problem(master, 0):
        return (f"launcher.master_addr={master} is not an address of this host, and node 0 (launcher.node_rank=0) "
                f"hosts the controller there: start node 0 on {master}, or give this host's address on every node")
    if node_addr and _listen_problem(node_addr, 0):
        return (f"launcher.node_addr={node_addr} is not an address of this host: give one of its own, or leave it "
                "null (its address on the route to launcher.master_addr)")
    return ports_problem(launcher) if node0 else None


def ports_problem(launcher) -> str | None:
    """What keeps node 0 from listening on its ports, or None (a port of 0 is picked free)."""
    port = launcher.master_port
    if port and (err := _listen_problem("", port)):
        return (f"launcher.master_port={port} cannot be listened on here ({_why(err)}; node 0's c10d store): "
                "stop what holds it, or give every node another free port")
    port = launcher.control_port
    if launcher.nnodes > 1 and (err := _listen_problem(launcher.master_addr, port)):
        return (f"launcher.control_port={port} cannot be listened on here ({_why(err)}; the agents' link, "
                "master_port + 1 unless set): stop what holds it, or give every node another launcher.master_port")
    return None


def store_problem(host: str, port: int) -> str | None:
    """Why an agent cannot reach node 0's c10d store, or None."""
    try:
        socket.create_connection((host, port), timeout=PROBE_S).close()
    except OSError as err:
        return (f"node 0's c10d store at {host}:{port} cannot be reached from this host ({_why(err)}), though its "
                "control link can: let this host reach node 0 on launcher.master_port")
    return None


def _listen_problem(host: str, port: int) -> OSError | None:
    """Why a listening socket on ``(host, port)`` cannot be opened ("": every address, as the c10d store binds)."""
    try:
        if host:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            socket.create_server((host, port), family=family).close()
        elif socket.has_dualstack_ipv6():
            socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True).close()
        else:
            socket.create_server(("", port)).close()
    except OSError as err:
        return err
    return None


def _why(err: OSError) -> str:
    """The system's words for ``err`` (without what ``socket.create_server`` adds to them)."""
    if err.errno and err.errno > 0:
        return os.strerror(err.errno)
    return err.strerror or str(err) or type(err).__name__
