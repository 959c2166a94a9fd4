"""Every party's bounds on silence, from the one ``ft.heartbeat_timeout_s`` and ``launcher.join_timeout_s``.

The controller, the agents and the workers each wait on the others; each bound is set here
so that they nest: a worker is hung before its node is lost, an agent renews its lease well
inside the controller's bound, and fences its workers only after the controller has given
its node up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    """Seconds each party waits (see the module doc)."""

    hung_s: float  # the agent: a worker whose heartbeat counter stands this long is hung
    lease_s: float  # the controller: a node whose agent says nothing this long is lost
    renew_s: float  # an agent: the longest it says nothing before it renews its lease
    contact_s: float  # an agent: silence from the controller this long cuts its node off (it fences its workers)
    confirm_s: float  # a worker: how long it waits for the controller to confirm a peer's fault
    start_s: float  # the controller: a node taken on by the job and not heard from since is lost after this

    @classmethod
    def of(cls, config) -> Timeouts:
        """The bounds of a (typed) config."""
        beat = config.ft.heartbeat_timeout_s
        return cls(hung_s=beat, lease_s=beat, renew_s=beat / 4, contact_s=2 * beat, confirm_s=2 * beat + 1.0,
                   start_s=config.launcher.join_timeout_s)
