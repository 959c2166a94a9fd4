"""The planner's background work and the recovery decisions, named: small picklable requests (a precompute, a
growth, a reshape, a recovery) that a :class:`Workshop` — a planner and a coordinator, and the precomputes they
searched — carries out, and where they run (a :class:`Planning`).

The core only ever submits requests and polls the futures it gets back (:mod:`~chameleon.runtime.control.background`);
where the workshop lives is the edge's choice: in threads of the controller's own process (:class:`InThreads`; the
tests drive its executors by hand), or in a child process (:mod:`~chameleon.runtime.control.offload`), out of the event
loop's GIL. Both run the same requests through the same :meth:`Workshop.serve`, on two lanes: the planner's
(precomputes, growths, reshapes) and the decisions' (recoveries), so a long precompute never delays a decision.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from chameleon.decision.config import PolicyConfig
from chameleon.decision.coordinator import Coordinator, Transition
from chameleon.decision.planner import Gate, Planner, Precomputed
from chameleon.decision.profiler import Profile
from chameleon.decision.selector import Decision, precompute_replans
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import Manifest
from chameleon.model.config import ModelConfig
from chameleon.runtime.control.background import placed_ahead
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.messages import Moves, Parcels, parcel
from chameleon.runtime.protocol.topology import Topology

PLANNER, DECIDER = "planner", "decider"  # the two lanes
AHEAD_KEPT = 3  # precomputes kept by a workshop (the resident plan's, and the last few before it)
ENCODED_KEPT = 2  # encoded moves kept by a workshop (a growth readied ahead, and the last decided)


@dataclass(frozen=True)
class CostModel:
    """What a planner and a coordinator are built from (all of it picklable: a child process builds its own)."""

    profile: Profile
    model: ModelConfig
    policy: PolicyConfig
    checkpoint_steps: int
    domains: tuple[tuple[int, ...], ...] | None
    dp_degrees: tuple[int, ...]
    pp_lengths: tuple[int, ...]
    tagless: bool = False  # the workers' backend ignores tags (NCCL, HCCL): plans unsafe there are never chosen

    def build(self) -> tuple[Planner, Coordinator]:
        planner = Planner(self.profile, dp_degrees=self.dp_degrees, pp_lengths=self.pp_lengths)
        return planner, Coordinator(model=self.model, profile=self.profile, planner=planner, policy=self.policy,
                                    checkpoint_steps=self.checkpoint_steps, domains=self.domains,
                                    tagless=self.tagless)


@dataclass(frozen=True)
class Parcelling:
    """Encodes every node's moves of ``generation`` (:func:`~chameleon.runtime.protocol.messages.parcel`)."""

    generation: int
    topology: Topology

    def __call__(self, manifest: Manifest) -> Parcels:
        return parcel(manifest, generation=self.generation, nodes=range(self.topology.nnodes),
                      node_of=self.topology.node_of)


def reframed(parcels: Parcels, generation: int) -> Parcels:
    """``parcels``, encoded for another ``generation`` (a rare fallback: another generation was published while they
    were encoded). Each node's part is taken from its frame, not from the manifest: the manifest may never have come
    to this process (:mod:`~chameleon.runtime.control.offload` sends back only its frames and node 0's
    :class:`~chameleon.runtime.protocol.messages.Moves`). A part is independent of the generation, so the frames mean
    what :func:`~chameleon.runtime.protocol.messages.parcel` of the manifest for ``generation`` would; nodes that
    shared a frame (the empty part) share the new one."""
    again: dict[int, tuple[Moves, bytes]] = {}  # by id() of the old frame
    sends = {}
    for node, (moves, payload) in parcels.sends.items():
        done = again.get(id(payload))
        if done is None:
            part = (moves if moves is not None else codec.decode(payload)).manifest
            moved = Moves(generation, part)
            done = again[id(payload)] = moved, codec.encode(moved)
        sends[node] = done
    return Parcels(generation, sends)


class _Pauses:
    """The pauses of the collector under way in this process (threads, nesting), and whether it ran before the
    first."""

    def __init__(self):
        self.lock = threading.Lock()
        self.depth = 0
        self.enabled = True


_PAUSES = _Pauses()


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused for a request, as it was after the last of those that overlap: a
    decision allocates objects by the hundred thousand (its manifest's moves), and every full collection they would
    set off on the way walks the whole heap (0.2 s each at 4,096 devices); they are collected afterwards
    (:func:`collect_unless_paused`)."""
    with _PAUSES.lock:
        if not _PAUSES.depth:
            _PAUSES.enabled = gc.isenabled()
        _PAUSES.depth += 1
        gc.disable()
    try:
        yield
    finally:
        with _PAUSES.lock:
            _PAUSES.depth -= 1
            if not _PAUSES.depth and _PAUSES.enabled:
                gc.enable()


def collect_unless_paused() -> None:
    """A full collection now, unless a pause is under way (:func:`collector_paused`): what the pauses deferred is
    collected at a moment of the caller's choosing, not in the first allocations after them (a planning process's
    next request)."""
    if not _PAUSES.depth:
        gc.collect()


class Workshop:
    """A planner and a coordinator, and the precomputes searched with them (by token: a request names the one it
    places from). Each request runs on its lane's one thread; the two lanes share it, and the decisions' goes first:
    while it decides, the planner's searches wait (:class:`~chameleon.decision.planner.Gate`)."""

    def __init__(self, planner: Planner | None = None, coordinator: Coordinator | None = None):
        self.planner, self.coordinator = planner, coordinator
        self.ahead: dict[int, Precomputed] = {}
        self.gate = Gate()  # closed while a decision runs: the precompute's searches wait
        self.encoded: list[tuple[Manifest, Parcelling, Parcels]] = []  # the last few (:data:`ENCODED_KEPT`)

    def use(self, planner: Planner, coordinator: Coordinator) -> None:
        self.planner, self.coordinator = planner, coordinator
        planner.gate = self.gate
        self.ahead, self.encoded = {}, []

    def keep(self, token: int, ahead: Precomputed) -> None:
        self.ahead[token] = ahead
        for old in sorted(self.ahead)[:-AHEAD_KEPT]:
            del self.ahead[old]

    def parcelled(self, decide: Callable[[], object], parcelling: Parcelling) -> tuple[object, Parcels | None]:
        """``decide()``, and the :class:`~chameleon.runtime.protocol.messages.Moves` of the transition it returns, if
        that moves state, encoded by ``parcelling`` in the same thread (the event loop only sends them); a manifest
        encoded for the same generation before (a growth readied ahead: :class:`GrowAhead`) is not encoded again."""
        outcome = decide()
        manifest = getattr(outcome, "manifest", None)
        if manifest is None:
            return outcome, None
        for known, how, parcels in self.encoded:
            if known is manifest and how == parcelling:
                return outcome, parcels
        parcels = parcelling(manifest)
        self.encoded[:] = [(manifest, parcelling, parcels), *self.encoded[:ENCODED_KEPT - 1]]
        return outcome, parcels

    def serve(self, request: Request) -> object:
        """Carry ``request`` out with Python's cyclic collector paused (:func:`collector_paused`: at 8,192 devices its
        passes over the precomputes' 720,000 live objects were a third of a node loss's decision with its placement
        and encoding, 1.03 → 0.68 s); a decision holds the planner's searches ahead of need (:class:`Gate`)
        meanwhile."""
        with collector_paused():
            if request.lane != DECIDER:
                return request.run(self)
            with self.gate.closed():
                return request.run(self)


class Request(ABC):
    """Work for a workshop, named (no closure): ``run`` carries it out; ``lane``: whose thread runs it."""

    lane: ClassVar[str] = PLANNER
    resident: Plan

    @abstractmethod
    def run(self, shop: Workshop) -> object: ...


@dataclass(frozen=True)
class Precompute(Request):
    """The searches ahead for ``resident`` (:func:`~chameleon.decision.selector.precompute_replans`), kept by the
    workshop as ``token``; its result is the token."""

    token: int
    resident: Plan
    losses: frozenset[int]
    back: frozenset[int]

    def run(self, shop: Workshop) -> int:
        shop.keep(self.token, precompute_replans(self.resident, shop.planner, set(self.losses), set(self.back)))
        shop.coordinator.holdings(self.resident)  # the next transition's manifest starts from them
        return self.token


@dataclass(frozen=True)
class Grow(Request):
    """:meth:`Coordinator.grow` from the precomputed shape over every stage unit with the devices back, placed
    (``ahead``: the precompute for ``resident``, if any: on the same lane, it ran before), and its moves encoded.
    Given ``ran`` (a plan that ran on exactly those devices, the precompute not yet finished), from that plan instead,
    on the decisions' lane: a node back to where it was is decided without waiting for the precompute."""

    resident: Plan
    ahead: int | None
    parcel: Parcelling
    kwargs: dict = field(default_factory=dict)
    ran: Plan | None = None

    @property
    def lane(self) -> str:
        return PLANNER if self.ran is None else DECIDER

    def run(self, shop: Workshop) -> tuple[Transition | Decision, Parcels | None]:
        return shop.parcelled(lambda: self._grow(shop), self.parcel)

    def _grow(self, shop: Workshop) -> Transition | Decision:
        kwargs = self.kwargs
        devices = set(self.resident.devices) | kwargs["joining"] | kwargs["alive"]
        placed = self.ran or placed_ahead(shop.ahead.get(self.ahead), self.resident, devices, shop.coordinator.profile)
        return shop.coordinator.grow(self.resident, precomputed=placed, **kwargs)


@dataclass(frozen=True)
class GrowAhead(Grow):
    """The :class:`Grow` the core will ask for once every device now out of the job is back, decided before they are
    (after the precompute, on the planner's lane): the manifest and the encoded moves it builds are kept (the
    coordinator's and the workshop's last few), so the growth itself finds them built if it chooses the same plan —
    at 8,192 devices, most of a growth's time. Nobody reads its result; it gives way to a decision under way before it
    starts."""

    def run(self, shop: Workshop) -> None:
        shop.gate.wait()
        super().run(shop)


@dataclass(frozen=True)
class Reshape(Request):
    """:meth:`Coordinator.reshape` around slow devices, and its moves encoded."""

    resident: Plan
    parcel: Parcelling
    kwargs: dict = field(default_factory=dict)

    def run(self, shop: Workshop) -> tuple[Transition | Decision, Parcels | None]:
        return shop.parcelled(lambda: shop.coordinator.reshape(self.resident, **self.kwargs), self.parcel)


@dataclass(frozen=True)
class Recover(Request):
    """:meth:`Coordinator.recover` from the precomputed shape for what survives, placed (``ahead``: the finished
    precompute for ``resident``, if any), and its moves encoded."""

    lane: ClassVar[str] = DECIDER
    resident: Plan
    ahead: int | None
    parcel: Parcelling
    kwargs: dict = field(default_factory=dict)

    def run(self, shop: Workshop) -> tuple[Transition, Parcels | None]:
        return shop.parcelled(lambda: self._recover(shop), self.parcel)

    def _recover(self, shop: Workshop) -> Transition:
        alive = self.kwargs["alive"]
        placed = placed_ahead(shop.ahead.get(self.ahead), self.resident, alive, shop.coordinator.profile)
        return shop.coordinator.recover(self.resident, precomputed=placed, **self.kwargs)


class Planning(Protocol):
    """Where requests run: ``submit`` returns the future of the request's result (its exception, if it raised);
    ``model`` gives the cost model the core built ``planner`` and ``coordinator`` from (a new one: the launch's
    topology became known); ``close`` ends whatever it started."""

    def submit(self, request: Request) -> Future: ...

    def model(self, cost: CostModel, planner: Planner, coordinator: Coordinator) -> None: ...

    def close(self) -> None: ...


class InThreads:
    """Requests on executors of this process, one per lane, with the core's own planner and coordinator (the tests'
    executors run by hand; the controller's, threads)."""

    def __init__(self, planner: Executor, decider: Executor):
        self.lanes = {PLANNER: planner, DECIDER: decider}
        self.shop = Workshop()

    def submit(self, request: Request) -> Future:
        return self.lanes[request.lane].submit(self.shop.serve, request)

    def model(self, cost: CostModel, planner: Planner, coordinator: Coordinator) -> None:
        self.shop.use(planner, coordinator)

    def close(self) -> None:
        """Nothing to end: the executors are the caller's."""

