"""Planning in an executor's thread, polled by the core: one search at a time per kind (a precompute, a growth,
a reshape, a recovery's decision)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from chameleon.decision.profiler import Profile
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import Manifest
from chameleon.runtime.protocol.messages import Parcels


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


def placed_ahead(precomputed: Future | None, resident: Plan, devices: Collection[int], profile: Profile) -> Plan | None:
    """The shape the precompute for ``resident`` searched for as many stage units as ``devices`` make up, filled with
    them and placed; None when it searched none for that many (or failed: a missing one). Called in a planning
    thread: it waits for the precompute if that is still under way."""
    if precomputed is None:
        return None
    units = geometry_of(resident).units(devices)
    with contextlib.suppress(Exception):
        return precomputed.result().plan_for(units, resident, profile)
    return None


def parcelled(decide: Callable, parcel: Callable[[Manifest], Parcels], /, *args,
              **kwargs) -> tuple[object, Parcels | None]:
    """``decide(*args, **kwargs)``, and the :class:`~chameleon.runtime.protocol.messages.Moves` of the transition it
    returns, if that moves state, encoded by ``parcel`` in the same thread: the event loop only sends them."""
    outcome = decide(*args, **kwargs)
    manifest = getattr(outcome, "manifest", None)
    return outcome, None if manifest is None else parcel(manifest)


class Background:
    """One kind of planning in an executor's thread, one search at a time: submitted, then polled until it has
    finished and taken. A new search or a cancel supersedes the one before: queued, it never runs; under way, it
    finishes unheard."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.search: Search | None = None

    @property
    def busy(self) -> bool:
        return self.search is not None

    def submit(self, resident: Plan, about: object, fn, /, *args, **kwargs) -> None:
        self.cancel()
        self.search = Search(resident, self.executor.submit(fn, *args, **kwargs), about)

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
