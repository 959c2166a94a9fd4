"""Algorithm 1: the best (possibly uneven) plan for a set of survivors.

The search space is the paper's: DP degree × partitions of the survivors into
pipelines of allowed lengths × a layer split per pipeline × micro-batch shares.
Every candidate is scored with the estimator's own terms — the slowest pipeline
(Eq. 10), the coloured DP sync of its distinct layer splits and the optimizer step
— and micro-batch shares are water-filled: the step is the smallest τ whose
per-pipeline capacities (most micro-batches finished within τ) cover the global
count, which is exact because a pipeline's time grows with its micro-batches.
Two searches cover the space:

* **Exact**, when the space is small (at most ``exact_limit`` layer splits of
  the allowed lengths, and at most ``exact_limit`` multisets of memory-feasible
  ones for the survivors): pipeline times are exact 1F1B longest paths (Eq. 11)
  and memory uses each pipeline's real in-flight count. The fast search's best
  seed the ``top_k``; a multiset (or a partial one) is skipped when a sound lower
  bound cannot beat the ``top_k``-th best: τ ≥ its longest fill (one micro-batch)
  and ≥ ``n_micro / Σ count/bottleneck`` (a busiest stage runs m·bottleneck),
  sync ≥ one round of its largest stage, plus its optimizer. The result equals an
  exhaustive search's.
* **Fast**, always run. Per length, the Pareto front of splits over (compute
  bottleneck, largest stage's parameters), each found by binary search under
  per-stage time, parameter and Eq. 14 memory caps; its time is the closed form
  ``fill + (m−1)·bottleneck`` (an upper bound of Eq. 11, exact for uniform
  stages). Partitions use at most two distinct lengths, O(k·|lengths|²) per DP
  degree; a partition's front combinations are scored only when a lower bound
  (fastest splits for compute, lightest for sync and optimizer) can enter the top
  ``top_k``, which are then re-scored with the exact estimator.

A search may be bounded in time (:meth:`Planner.within`): when its budget runs out it
returns the best partitions found so far, an anytime answer that is not cached. A search ahead of need (a
precompute) may give way to decisions (:class:`Gate`): it waits at its next step while one runs.

Both search under the job's activation recomputation (the profile's). When nothing fits so, the same search runs
with every stage recomputing as much as the profile prices (:attr:`Planner.recomputing`). Either way the plan built
recomputes only on the stages whose memory needs it
(:func:`~chameleon.decision.estimator.recomputed_to_fit`) and is priced so.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

import numpy as np

from chameleon.decision import estimator as est
from chameleon.decision.profiler import Profile
from chameleon.layout.geometry import Geometry, coverage, geometry_of
from chameleon.layout.plan import Pipeline, Plan, PlanError, Recompute, Stage

_EPS = 1e-12

Shape = tuple[tuple["Split", int], ...]


@dataclass(frozen=True)
class Split:
    """One pipeline's layer split and its 1F1B terms.

    ``time`` is the closed form ``fill + (m−1)·bottleneck`` unless ``curve`` gives
    the exact 1F1B time; ``max_params`` is what one device of its largest stage
    holds; ``max_micro`` caps the micro-batches that fit in memory.
    """

    length: int
    layers: tuple[int, ...]
    fill: float
    bottleneck: float
    max_params: float
    max_micro: int | None = None
    curve: Callable[[int], float] | None = field(default=None, compare=False, repr=False)

    def time(self, n_micro: int) -> float:
        return self.curve(n_micro) if self.curve else self.fill + (n_micro - 1) * self.bottleneck

    def capacity(self, tau: float) -> int:
        """The most micro-batches this pipeline finishes within ``tau`` (and fits in memory)."""
        if tau + _EPS < self.fill:
            return 0
        count = int(math.floor((tau - self.fill) / self.bottleneck + 1e-9)) + 1
        if self.curve:
            # Exact time ≤ the closed form, and ≥ m·bottleneck (the busiest stage runs m F+B).
            hi = int(math.floor(tau / self.bottleneck + 1e-9))
            while count < hi:
                mid = (count + hi + 1) // 2
                count, hi = (mid, hi) if self.curve(mid) <= tau + _EPS else (count, mid - 1)
        return count if self.max_micro is None else min(count, self.max_micro)

    def bounds(self) -> tuple[tuple[int, int], ...]:
        out, start = [], 0
        for n in self.layers:
            out.append((start, start + n))
            start += n
        return tuple(out)


@dataclass(frozen=True)
class PlannerResult:
    """The chosen plan, its exact estimate, and how the search went."""

    plan: Plan
    estimate: est.StepEstimate
    search_s: float
    n_partitions: int


def _costs(profile: Profile, layers) -> tuple[list[float], list[float]]:
    last = len(layers) - 1
    pairs = [est.stage_cost(profile, n, first=s == 0, last=s == last) for s, n in enumerate(layers)]
    return [f for f, _ in pairs], [b for _, b in pairs]


def make_split(profile: Profile, layers, *, exact: bool = False, max_micro: int | None = None) -> Split:
    """The :class:`Split` of ``layers`` (layer counts per stage); ``exact`` attaches the Eq. 11 curve."""
    fwd, bwd = _costs(profile, layers)
    costs = [f + b for f, b in zip(fwd, bwd)]
    params = max(est.device_params(profile, n, first=s == 0, last=s == len(layers) - 1) for s, n in enumerate(layers))
    curve = lru_cache(maxsize=None)(lambda m: est.pipeline_time(fwd, bwd, m)) if exact else None
    return Split(len(layers), tuple(layers), sum(costs), max(costs), params, max_micro, curve)


def max_micro(profile: Profile, layers) -> int | None:
    """Most micro-batches a pipeline of ``layers`` holds within Eq. 14 memory (None: any; 0: none)."""
    length = len(layers)
    for m in range(length, 0, -1):
        fits = all(
            est.stage_memory(profile, n, first=s == 0, last=s == length - 1, in_flight=min(length - s, m))
            <= profile.memory_bytes
            for s, n in enumerate(layers)
        )
        if fits:
            return None if m == length else m
    return 0


def pareto_splits(profile: Profile, length: int) -> list[Split]:
    """Layer splits of ``length`` stages along the (compute bottleneck, largest stage params) front.

    The first is the min–max split (binary search on the bottleneck under per-stage
    Eq. 14 memory caps, every stage's ``length − s`` activations in flight); each
    next one is the min–max split whose stages all hold fewer parameters than the
    previous one's largest. Fastest first; empty when nothing fits.
    """
    n_layers = profile.n_layers
    if length > n_layers:
        return []
    unit = profile.layer_fwd_s + profile.layer_bwd_s
    layer_share = profile.layer_params / profile.tp  # what a layer adds to each device of its stage
    ends = [(s == 0, s == length - 1) for s in range(length)]
    extras, params0, caps_mem = [], [], []
    for s, (first, last) in enumerate(ends):
        extras.append(sum(est.stage_cost(profile, 0, first=first, last=last)))
        params0.append(est.device_params(profile, 0, first=first, last=last))
        in_flight = length - s
        fixed = est.stage_memory(profile, 0, first=first, last=last, in_flight=in_flight)
        per_layer = est.stage_memory(profile, 1, first=False, last=False, in_flight=in_flight) - est.stage_memory(
            profile, 0, first=False, last=False, in_flight=in_flight
        )
        caps_mem.append(int((profile.memory_bytes - fixed) // per_layer) if profile.memory_bytes > fixed else 0)

    def caps(time_cap: float, param_cap: float) -> list[int]:
        return [
            min(m, int(math.floor((time_cap - e) / unit + 1e-9)), int(math.floor((param_cap - q) / layer_share + 1e-9)))
            for e, q, m in zip(extras, params0, caps_mem)
        ]

    def feasible(time_cap: float, param_cap: float) -> bool:
        c = caps(time_cap, param_cap)
        return min(c) >= 1 and sum(c) >= n_layers

    def lowest(values: list[float], ok: Callable[[float], bool]) -> float | None:
        if not values or not ok(values[-1]):
            return None
        lo, hi = 0, len(values) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(values[mid]) else (mid + 1, hi)
        return values[lo]

    times = sorted({n * unit + e for n in range(1, n_layers + 1) for e in set(extras)})
    params = sorted({est.device_params(profile, n, first=f, last=l) for n in range(1, n_layers + 1) for f, l in set(ends)})
    front = []
    while params:
        time_cap = lowest(times, lambda t: feasible(t, params[-1]))
        if time_cap is None:
            break
        front.append(_fill(profile, caps(time_cap, params[-1])))
        params = [q for q in params if q < front[-1].max_params]
    return front


def _fill(profile: Profile, cap: list[int]) -> Split:
    """Layers within per-stage caps, filled from the back or from the front: the faster in exact 1F1B."""
    length, n_layers = len(cap), profile.n_layers
    fills = []
    for order in (range(length - 1, -1, -1), range(length)):
        layers, remaining = [0] * length, n_layers
        for s in order:
            before = s if order.step < 0 else length - 1 - s
            layers[s] = min(cap[s], remaining - before)
            remaining -= layers[s]
        fills.append(layers)
    layers = min(fills, key=lambda ls: (est.pipeline_time(*_costs(profile, ls), length), ls))
    return make_split(profile, layers)


def min_step(splits: list[tuple[Split, int]], n_micro: int) -> float | None:
    """Water-filling: the smallest τ at which ``count`` pipelines of each split cover ``n_micro``."""
    if sum(c for _, c in splits) > n_micro:
        return None
    floor = max(sp.fill for sp, _ in splits)

    def enough(tau: float) -> bool:
        return tau + _EPS >= floor and sum(c * sp.capacity(tau) for sp, c in splits) >= n_micro

    best = math.inf
    for sp, _ in splits:
        lo, hi = 1, n_micro
        if not enough(sp.time(hi)):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if enough(sp.time(mid)):
                hi = mid
            else:
                lo = mid + 1
        best = min(best, sp.time(lo))
    return None if math.isinf(best) else best


def shares(splits: list[Split], n_micro: int, tau: float) -> list[int]:
    """Micro-batches per pipeline: capacities at ``tau``, trimmed from the slowest until they sum to ``n_micro``."""
    counts = [sp.capacity(tau) for sp in splits]
    heap = [(-sp.time(m), -j) for j, (sp, m) in enumerate(zip(splits, counts))]
    heapq.heapify(heap)
    excess = sum(counts) - n_micro
    while excess > 0:
        _, neg_j = heapq.heappop(heap)
        j = -neg_j
        if counts[j] > 1:
            counts[j] -= 1
            excess -= 1
            heapq.heappush(heap, (-splits[j].time(counts[j]), neg_j))
    return counts


class _TopK:
    """The ``k`` lowest-valued shapes seen; ``bound`` is the value a newcomer must beat."""

    def __init__(self, k: int):
        self.k = k
        self.heap: list[tuple[float, tuple, Shape]] = []

    @property
    def bound(self) -> float:
        return -self.heap[0][0] if len(self.heap) == self.k else math.inf

    def push(self, value: float, shape: Shape) -> None:
        item = (-value, tuple((-sp.length, tuple(-n for n in sp.layers), -c) for sp, c in shape), shape)
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, item)
        elif item > self.heap[0]:
            heapq.heapreplace(self.heap, item)

    def best_first(self) -> list[tuple[float, Shape]]:
        return [(-v, shape) for v, _, shape in sorted(self.heap, reverse=True)]


class _Expired(Exception):
    """A bounded search ran out of its budget."""


class Gate:
    """Searches ahead of need give way to decisions: while a decision holds the gate closed (:meth:`closed`), a
    search of a planner that has this gate waits at its next step (:meth:`Planner.within` gives decisions a planner
    without it), so the decision has the process's interpreter to itself."""

    def __init__(self):
        self._open = threading.Event()
        self._open.set()

    @contextlib.contextmanager
    def closed(self):
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    def wait(self) -> None:
        if not self._open.is_set():  # a read, no lock: a search's every step passes here
            self._open.wait()


class Planner:
    """Algorithm 1 over one profile: exact on small spaces, fast on large ones; caches across calls.

    Args:
        profile: Costs of a stage unit.
        dp_degrees: Allowed pipeline counts; empty means any.
        pp_lengths: Allowed pipeline lengths; empty means 1..n_layers.
        top_k: Partitions re-scored with the exact estimator.
        exact_limit: The exact search runs when there are at most this many layer splits
            of the allowed lengths and this many multisets of them for the survivors.
        min_dp: The fewest pipelines a plan may have (2: every layer on two devices).

    ``job`` is the profile plans are fitted to memory and priced with: ``profile`` itself, except in
    :attr:`recomputing`, which searches under another recomputation.
    """

    def __init__(
        self, profile: Profile, *, dp_degrees: tuple[int, ...] = (), pp_lengths: tuple[int, ...] = (), top_k: int = 4,
        exact_limit: int = 4000, min_dp: int = 1,
    ):
        self.profile = self.job = profile
        self.min_dp = min_dp
        self.dp_degrees = frozenset(dp_degrees)
        lengths = sorted(set(pp_lengths or range(1, profile.n_layers + 1)))
        self.fronts = {p: front for p in lengths if (front := pareto_splits(profile, p))}
        self.splits = {p: front[0] for p, front in self.fronts.items()}
        self.top_k = top_k
        self.exact_limit = exact_limit
        self.lengths = tuple(lengths)
        self._rounds = lru_cache(maxsize=None)(self._round_params)
        self._searched: dict[tuple[int, int], list] = {}
        self.deadline: float | None = None  # time.perf_counter() past which a search returns what it has
        self.expired = False  # a search of this (bounded) planner ran out of time
        self.gate: Gate | None = None  # searches ahead of need wait at it while a decision runs
        self._cut: dict[tuple[int, int], list] = {}  # its searches cut short: reused by its own later calls only

    def within(self, budget_s: float | None) -> "Planner":
        """This planner for a decision, sharing its caches, whose searches stop ``budget_s`` seconds from now with
        the best they found (None: unbounded; this planner itself when it has no :class:`Gate` to leave out)."""
        if budget_s is None and self.gate is None:
            return self
        bounded, twin = copy.copy(self), copy.copy(self.replicated)
        bounded.deadline = twin.deadline = None if budget_s is None else time.perf_counter() + budget_s
        bounded._cut, twin._cut = {}, {}
        bounded.gate = twin.gate = None
        bounded.__dict__["replicated"] = twin
        return bounded

    def _on_time(self) -> None:
        if self.gate is not None:
            self.gate.wait()
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.expired = True
            raise _Expired

    @cached_property
    def replicated(self) -> "Planner":
        """The same search restricted to plans of at least two pipelines (every layer held twice)."""
        twin = copy.copy(self)
        twin.min_dp, twin._searched = max(self.min_dp, 2), {}
        twin.__dict__.pop("recomputing", None)  # its own, of at least two pipelines too
        return twin

    @cached_property
    def recomputing(self) -> "Planner | None":
        """The same search with every stage under the leanest recomputation the profile prices, which :meth:`choose`
        falls back on when nothing fits under the job's; None when the profile prices none leaner."""
        leanest = self.profile.leaner[-1]
        if leanest == self.profile.recompute:
            return None
        twin = Planner(self.profile.under(leanest), dp_degrees=tuple(self.dp_degrees), pp_lengths=self.lengths,
                       top_k=self.top_k, exact_limit=self.exact_limit, min_dp=self.min_dp)
        twin.job = self.job
        return twin

    @cached_property
    def pool(self) -> tuple[Split, ...] | None:
        """Every memory-feasible split of the allowed lengths with its exact curve; None if over the limit."""
        n_layers = self.profile.n_layers
        if sum(math.comb(n_layers - 1, p - 1) for p in self.lengths if p <= n_layers) > self.exact_limit:
            return None
        pool = []
        for p in self.lengths:
            for cuts in itertools.combinations(range(1, n_layers), p - 1):
                layers = [b - a for a, b in zip((0,) + cuts, cuts + (n_layers,))]
                cap = max_micro(self.profile, layers)
                if cap != 0:
                    pool.append(make_split(self.profile, layers, exact=True, max_micro=cap))
        return tuple(pool)

    def _round_params(self, splits: tuple[Split, ...]) -> tuple[float, ...]:
        """Largest bucket (elements per device) of each coloured sync round when pipelines of ``splits`` coexist.

        They are the rounds of the geometry of a plan holding each split once, on
        placeholder devices; a lone split twice, as a sync needs two holders (a second
        copy conflicts where the first does).
        """
        ids, tp, copies = itertools.count(), self.profile.tp, 2 if len(splits) == 1 else 1
        pipes = tuple(Pipeline(tuple(Stage(tuple(itertools.islice(ids, tp)), b) for b in sp.bounds()), 1)
                      for sp in splits for _ in range(copies))
        g = Geometry(Plan(n_layers=self.profile.n_layers, micro_batch_size=1, pipelines=pipes))
        return tuple(max(g.sync_size(b, self.profile.units)[1] for b in r) for r in g.rounds)

    def _fixed(self, splits: tuple[Split, ...], k: int) -> float:
        """DP sync (coloured rounds over ``k`` pipelines) + optimizer step of a set of distinct splits."""
        sync = sum(est.allreduce_time(self.profile, k, p) for p in self._rounds(splits)) if k > 1 else 0.0
        return sync + self._optimizer(max(sp.max_params for sp in splits))

    def _floor(self, params: float, k: int) -> float:
        """Lower bound of :meth:`_fixed` when the largest stage holds ``params``: one sync round + optimizer."""
        return est.allreduce_time(self.profile, k, params) + self._optimizer(params)

    def _optimizer(self, params: float) -> float:
        return params * self.profile.optimizer_s_per_param

    def _resolve(self, counts: dict) -> Shape:
        """``{length or Split: count}`` as ``((Split, count), ...)``; a length means its fastest split."""
        pairs = [(self.splits[sp] if isinstance(sp, int) else sp, c) for sp, c in counts.items() if c]
        return tuple(sorted(pairs, key=lambda x: (x[0].length, x[0].layers)))

    def objective(self, counts: dict, n_micro: int) -> float | None:
        """Step time of a partition ``{length or Split: count}`` (closed form unless splits are exact), or None."""
        shape = self._resolve(counts)
        tau = min_step(list(shape), n_micro)
        if tau is None:
            return None
        return tau + self._fixed(tuple(sp for sp, _ in shape), sum(c for _, c in shape))

    def _allowed(self, k: int, n_micro: int) -> bool:
        return self.min_dp <= k <= n_micro and (not self.dp_degrees or k in self.dp_degrees)

    def partitions(self, n_units: int, n_micro: int) -> Iterator[dict[int, int]]:
        """Length counts ``{length: count}`` with at most two distinct lengths, every unit used."""
        lengths = sorted(self.splits)
        if not lengths:
            return
        k_lo, k_hi = -(-n_units // lengths[-1]), min(n_units // lengths[0], n_micro)
        for k in range(max(k_lo, 1), k_hi + 1):
            if not self._allowed(k, n_micro):
                continue
            if n_units % k == 0 and n_units // k in self.splits:
                yield {n_units // k: k}
            for i, p1 in enumerate(lengths):
                if p1 * k >= n_units:
                    break
                for p2 in lengths[i + 1:]:
                    c2, rem = divmod(n_units - k * p1, p2 - p1)
                    if rem == 0 and 0 < c2 < k:
                        yield {p1: k - c2, p2: c2}

    def exact_fits(self, n_units: int) -> bool:
        """Whether at most ``exact_limit`` multisets of pool pipelines cover ``n_units`` (any DP degree)."""
        if self.pool is None:
            return False
        ways = [1] + [0] * n_units
        for sp in self.pool:
            for n in range(sp.length, n_units + 1):
                ways[n] += ways[n - sp.length]
            if ways[n_units] > self.exact_limit:  # counts only grow as splits are added
                return False
        return True

    def _exact(self, n_units: int, n_micro: int, seeds: list[Shape], top: _TopK) -> None:
        """Every multiset of pool splits into ``top``, pruned by lower bounds against ``seeds`` (scored exactly)
        and finds."""
        pool = self.pool
        exact = {sp.layers: sp for sp in pool}
        for shape in seeds:
            shape = tuple((exact[sp.layers], c) for sp, c in shape)
            top.push(self.objective(dict(shape), n_micro), shape)

        def visit(start: int, remaining: int, shape: Shape, k: int, fill: float, params: int) -> None:
            self._on_time()
            if remaining == 0:
                if not self._allowed(k, n_micro):
                    return
                # A pipeline's busiest stage runs m·bottleneck, so τ ≥ n_micro / Σ count/bottleneck.
                rate = sum(c / sp.bottleneck for sp, c in shape)
                lower = max(fill, n_micro / rate)
                if lower + self._floor(params, k) >= top.bound:
                    return  # before the coloured rounds, which cost a geometry per new set of splits
                fixed = self._fixed(tuple(sp for sp, _ in shape), k)
                if lower + fixed >= top.bound:
                    return
                tau = min_step(list(shape), n_micro)
                if tau is not None:
                    top.push(tau + fixed, shape)
                return
            for i in range(start, len(pool)):
                sp = pool[i]
                f, q = max(fill, sp.fill), max(params, sp.max_params)
                for c in range(1, remaining // sp.length + 1):
                    more = remaining > c * sp.length
                    if k + c + more > n_micro or f + self._floor(q, k + c + more) >= top.bound:
                        break
                    visit(i + 1, remaining - c * sp.length, shape + ((sp, c),), k + c, f, q)

        visit(0, n_units, (), 0, 0.0, 0)

    def _fast(self, n_units: int, n_micro: int, top: _TopK) -> None:
        """Partitions with ≤ 2 lengths × their front splits, skipped when a lower bound cannot enter ``top``."""
        for counts in self.partitions(n_units, n_micro):
            self._on_time()
            lengths = sorted(counts)
            fronts = [self.fronts[p] for p in lengths]
            k = sum(counts.values())
            if any(len(fr) > 1 for fr in fronts):
                tau = min_step([(fr[0], counts[p]) for fr, p in zip(fronts, lengths)], n_micro)
                if tau is None or tau + self._floor(max(fr[-1].max_params for fr in fronts), k) >= top.bound:
                    continue
            for combo in itertools.product(*fronts):
                self._on_time()
                shape = tuple((sp, counts[sp.length]) for sp in combo)
                value = self.objective(dict(shape), n_micro)
                if value is not None:
                    top.push(value, shape)

    def search(self, n_units: int, n_micro: int) -> list[tuple[float, dict[Split, int]]]:
        """The ``top_k`` partitions ``{Split: count}`` by step time, best first (exact search when small); cached
        unless the search ran out of its budget."""
        key = (n_units, n_micro)
        for known in (self._searched, self._cut):
            if key in known:
                return known[key]
        top = _TopK(self.top_k)
        try:
            self._fast(n_units, n_micro, top)
            if self.exact_fits(n_units):
                seeds, top = [shape for _, shape in top.best_first()], _TopK(self.top_k)
                self._exact(n_units, n_micro, seeds, top)
        except _Expired:
            self._cut[key] = [(v, dict(shape)) for v, shape in top.best_first()]
            return self._cut[key]
        self._searched[key] = [(v, dict(shape)) for v, shape in top.best_first()]
        return self._searched[key]

    def build(self, counts: dict, units: list[tuple[int, ...]], *, n_micro: int, micro_batch_size: int) -> Plan:
        """The plan of a partition ``{length or Split: count}``: pipelines shortest first, devices in ``units`` order,
        stages recomputing where their memory needs it."""
        shape = self._resolve(counts)
        splits = [sp for sp, c in shape for _ in range(c)]
        micro = shares(splits, n_micro, min_step(list(shape), n_micro))
        pipelines, it = [], iter(units)
        for sp, m in zip(splits, micro):
            stages = tuple(Stage(devices=next(it), layers=b, recompute=Recompute(self.job.recompute))
                           for b in sp.bounds())
            pipelines.append(Pipeline(stages=stages, micro_batches=m))
        plan = Plan(n_layers=self.profile.n_layers, micro_batch_size=micro_batch_size, pipelines=tuple(pipelines))
        return est.recomputed_to_fit(self.job, plan)

    def choose(self, units: list[tuple[int, ...]], *, n_micro: int, micro_batch_size: int) -> Plan:
        """The best plan on ``units`` (TP groups, placed in order): top partitions re-scored exactly; when none fits
        in memory, :attr:`recomputing`'s.

        Raises:
            PlanError: When no partition fits the allowed lengths, DP degrees and memory, even recomputing.
        """
        top = self.search(len(units), n_micro) if units else []
        if units and not top and not self.expired and self.recomputing is not None:
            left = None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())
            return self.recomputing.within(left).choose(units, n_micro=n_micro, micro_batch_size=micro_batch_size)
        if not top and self.expired:
            raise PlanError(f"no plan for {len(units)} stage units found within the decision's budget "
                            "(policy.decide_budget_s): raise it, or let the planner precompute (policy.precompute)")
        if not top:
            raise PlanError(
                f"no plan for {len(units)} stage units: widen policy.pp_lengths / policy.dp_degrees, "
                "or give devices more memory (cluster.memory_gb)"
            )
        scored = []
        for rank, (value, counts) in enumerate(top):
            plan = self.build(counts, units, n_micro=n_micro, micro_batch_size=micro_batch_size)
            scored.append((est.estimate_step(self.job, plan).t_step, value, rank, plan))
        return min(scored, key=lambda x: x[:3])[3]

    def best(
        self, units: list[tuple[int, ...]], *, n_micro: int, micro_batch_size: int, previous: Plan | None = None
    ) -> PlannerResult:
        """:meth:`choose`, with devices placed to move the least state from ``previous``."""
        start = time.perf_counter()
        plan = self.choose(units, n_micro=n_micro, micro_batch_size=micro_batch_size)
        if previous is not None:
            plan = place(plan, previous, self.profile)
        search_s = time.perf_counter() - start
        return PlannerResult(plan, est.estimate_step(self.job, plan), search_s, self.top_k)


def place(plan: Plan, previous: Plan, profile: Profile) -> Plan:
    """Reassign ``plan``'s stage units to minimise the state bytes each lacks from ``previous``.

    The cost of putting unit ``u`` on slot ``v`` is the weights + AdamW moments of the
    regions ``v``'s devices need that ``u``'s devices, TP index by TP index, did not
    hold under ``previous`` (the geometry's :meth:`~chameleon.layout.geometry.Holding.lacks`):
    a unit regrouped from the shards of different replicas costs nothing on the stage
    it rebuilds. Solved as an assignment (Hungarian) problem over TP groups; slots
    needing the same regions, and groups holding the same ones, are interchangeable,
    so it is a transportation problem between those classes (an LP whose vertices are
    integral): the same optimum, in time independent of the device count.
    """
    old, new, n = geometry_of(previous), Geometry(plan), plan.n_layers
    groups = [st.devices for st in new.stages]
    need_kinds, slot_kind = _classes([new.holding(g[0]) for g in groups])  # shard 0's: every shard needs as much
    have_kinds, group_kind = _classes([tuple(map(old.holding, g)) for g in groups])
    need = np.array([h.sizes(profile.units, n) for h in need_kinds])
    # per group kind and unit: the shares of the slot's shards its devices hold (device t: shard t)
    held = np.array([sum(coverage(have, t, len(haves), n) for t, have in enumerate(haves)) for haves in have_kinds])
    cost = need @ (new.width - held).T * profile.state.moved
    flow = _transport(cost, np.bincount(slot_kind), np.bincount(group_kind))
    slots_of = [iter(np.flatnonzero(slot_kind == a).tolist()) for a in range(len(need_kinds))]
    groups_of = [iter(np.flatnonzero(group_kind == b).tolist()) for b in range(len(have_kinds))]
    assign = {next(slots_of[a]): next(groups_of[b]) for a, b in zip(*np.nonzero(flow)) for _ in range(flow[a, b])}
    slot_ids = iter(range(len(groups)))  # slots are listed in pipeline-then-stage order
    pipelines = tuple(
        Pipeline(stages=tuple(replace(st, devices=groups[assign[next(slot_ids)]]) for st in p.stages), micro_batches=p.micro_batches)
        for p in plan.pipelines
    )
    return Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=pipelines)


def _classes(items: list) -> tuple[list, np.ndarray]:
    """The distinct ``items`` (first seen first) and each item's index among them."""
    index: dict = {}
    kinds = np.array([index.setdefault(item, len(index)) for item in items], dtype=int)
    return list(index), kinds


def _transport(cost: np.ndarray, supply: np.ndarray, demand: np.ndarray) -> np.ndarray:
    """Integral min-cost flow ``x[a, b]`` with row sums ``supply`` and column sums ``demand`` (balanced)."""
    n_a, n_b = cost.shape
    if n_a == 1 or n_b == 1:
        return demand[None, :] if n_a == 1 else supply[:, None]
    linprog = _linprog()
    rows = np.zeros((n_a + n_b, n_a * n_b))
    for a in range(n_a):
        rows[a, a * n_b:(a + 1) * n_b] = 1
    for b in range(n_b):
        rows[n_a + b, b::n_b] = 1
    result = linprog(cost.ravel(), A_eq=rows, b_eq=np.concatenate([supply, demand]), bounds=(0, None), method="highs-ds")
    return np.rint(result.x).astype(int).reshape(n_a, n_b)


def _linprog():
    """scipy's LP solver, imported on first use: 0.4 s, never on a start-up's path (one kind of slot is the rule
    there), and loaded by :func:`precompute` so that no fault's placement waits for it."""
    from scipy.optimize import linprog

    return linprog


def refill(plan: Plan, units: list[tuple[int, ...]]) -> Plan:
    """``plan``'s shape with its stages given ``units`` in order (pipeline by pipeline); extra units idle."""
    it = iter(units)
    pipelines = tuple(
        Pipeline(stages=tuple(replace(st, devices=next(it)) for st in p.stages), micro_batches=p.micro_batches)
        for p in plan.pipelines
    )
    return Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=pipelines)


@dataclass(frozen=True)
class Precomputed:
    """The planner's best plan shapes, searched ahead for the faults likely next, by the stage units they leave.

    Every fault that leaves the same number of units is served by one search (the
    shape does not depend on which units are left); only placing the survivors, at the
    fault, depends on it, and costs a transport problem, not a search.
    """

    shapes: dict[int, Plan]

    def plan_for(self, units: list[tuple[int, ...]], previous: Plan, profile: Profile) -> Plan | None:
        """The precomputed shape for ``units`` filled with them and placed to move the least state from
        ``previous``; None when no shape was searched for that many units."""
        shape = self.shapes.get(len(units))
        return None if shape is None else place(refill(shape, units), previous, profile)


def precompute(plan: Plan, planner: Planner, losses, back: Collection[int] = ()) -> Precomputed:
    """Search the best shape for each number of stage units ``plan`` keeps after losing ``losses`` of them (a
    device's unit, a node's units…), and for the units it and the devices ``back`` (away now, likely to return)
    make up, so that neither a fault nor a growth onto those devices needs a search."""
    geometry = geometry_of(plan)
    units = geometry.units(plan.devices)
    sets = [units[:len(units) - lost] for lost in sorted(set(losses)) if lost < len(units)]
    if back:
        sets.append(geometry.units(set(plan.devices) | set(back)))
    shapes = {}
    for some in sets:
        try:
            shapes[len(some)] = planner.choose(some, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size)
        except PlanError:
            continue
    _linprog()  # placing survivors at a fault may need it (several kinds of slot): loaded now, off the fault's path
    return Precomputed(shapes)
