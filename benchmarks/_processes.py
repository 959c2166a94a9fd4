"""Which processes a finished run left behind (shared by the chaos soak and the tests)."""

from __future__ import annotations

import time
from pathlib import Path


def session_processes(session: int) -> list[int]:
    """Live (non-zombie) processes of a session; a run's controller, forkserver and workers share one."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != b"Z":
            found.append(int(stat.parent.name))
    return found


def lingering(session: int, grace_s: float = 3.0) -> list[int]:
    """The session's processes still alive ``grace_s`` after the run (helpers exit a moment after their parent)."""
    deadline = time.monotonic() + grace_s
    while (found := session_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
