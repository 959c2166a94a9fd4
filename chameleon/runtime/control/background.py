"""Planning in the background, polled by the core: one search at a time per kind (a precompute, a growth,
a reshape, a recovery's decision), each a request (:mod:`~chameleon.runtime.control.planning`) run where the edge
said (a thread, a child process)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chameleon.decision.profiler import Profile
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import Plan

if TYPE_CHECKING:
    from chameleon.decision.planner import Precomputed
    from chameleon.runtime.control.planning import Planning, Request


@dataclass
class Search:
    """Planning under way in a background thread, for the plan resident when it began, and what it is about: the
    devices a growth would take in, the slow devices a reshape plans around with their factors, the loss a
    recovery decides on."""

    resident: Plan
    future: Future
    about: object

    def stands(self, resident: Plan) -> bool:
        """Whether it was searched for ``resident`` and has finished."""
        return self.resident is resident and self.future.done()


def placed_ahead(precomputed: Precomputed | None, resident: Plan, devices: Collection[int],
                 profile: Profile) -> Plan | None:
    """The shape the precompute for ``resident`` searched for as many stage units as ``devices`` make up, filled with
    them and placed; None when it searched none for that many (or none was searched, or it failed: a missing one).
    Called where the planning runs."""
    if precomputed is None:
        return None
    units = geometry_of(resident).units(devices)
    with contextlib.suppress(Exception):
        return precomputed.plan_for(units, resident, profile)
    return None


class Background:
    """One kind of planning, one search at a time: a request submitted to ``planning``, then polled until it has
    finished and taken. A new search or a cancel supersedes the one before: queued, it never runs; under way, it
    finishes unheard."""

    def __init__(self, planning: Planning):
        self.planning = planning
        self.search: Search | None = None

    @property
    def busy(self) -> bool:
        return self.search is not None

    def submit(self, resident: Plan, about: object, request: Request) -> None:
        self.cancel()
        self.search = Search(resident, self.planning.submit(request), about)

    def finished(self) -> Search | None:
        """The search, taken, once it has finished; None while it runs, or when there is none."""
        if self.search is None or not self.search.future.done():
            return None
        search, self.search = self.search, None
        return search

    def cancel(self) -> None:
        if self.search is not None:
            self.search.future.cancel()
            self.search = None
