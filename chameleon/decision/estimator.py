"""Performance model: step time, memory and transition cost of a plan (paper Eqs. 9–14).

Step time = slowest pipeline's 1F1B schedule (Eq. 10/11, an exact longest path
through the schedule's dependency DAG, stages may differ; with reroutes, the
runtime's own merged schedule, or Eq. 12/13's extra slots on request) + the
runtime's coloured DP gradient-sync rounds + the optimizer step + the commit
round trip. On CPU profiles, whose devices are processes sharing their node's
cores, the 1F1B phase is a processor-sharing simulation of every op and the rest
is stretched by the share of a core each process gets. Stage costs fold the point-to-point activation transfer into
the sending stage (blocking send), so the closed form ``fill + (m−1)·bottleneck``
is exact for uniform stages (Eq. 9) and an upper bound otherwise. Slow devices (``speeds``:
device → how many times slower it computes) stretch every op of their stage and the
optimizer step. Each stage is priced under its own activation recomputation (its backward reruns
that share of its forward: :meth:`~chameleon.decision.profiler.Profile.under`); a plan over memory recomputes on
the stages that need it (:func:`recomputed_to_fit`). Memory is
:mod:`chameleon.layout.memory` (Eq. 14), the model config validation uses too. Who
holds what — sync buckets and rounds, each device's share, what a device lacks after
a re-plan — is the plan's :mod:`~chameleon.layout.geometry`, bytes per element its
:class:`~chameleon.layout.geometry.StateBytes`.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from types import MappingProxyType

from chameleon.decision.profiler import Profile, ring_all_reduce_s
from chameleon.layout import memory
from chameleon.layout.geometry import geometry_of, per_device
from chameleon.layout.plan import Plan, Stage, recomputing
from chameleon.layout.schedule import Action, dependency, executors, one_f_one_b, step_actions

REROUTE_SLOTS = ("schedule", "max", "sum")


@dataclass(frozen=True)
class StepEstimate:
    """Estimated step time of a plan and its parts (seconds).

    ``t_step = compute + reroute + sync + optimizer + commit``, except on shared CPU
    cores: ``shared_compute + cpu_share · (reroute + sync + optimizer) + commit``.
    The parts are unshared.
    """

    t_step: float
    compute: float
    reroute: float
    sync: float
    optimizer: float
    sync_rounds: int
    pipelines: tuple[float, ...]
    cpu_share: float = 1.0
    shared_compute: float = 0.0


def stage_cost(profile: Profile, n_layers: int, *, first: bool, last: bool, tp: int = 0) -> tuple[float, float]:
    """Forward and backward seconds per micro-batch of a stage, including its p2p sends; its layers at TP size
    ``tp`` (0: the profile's) as :meth:`~chameleon.decision.profiler.Profile.layer_s` prices them."""
    p2p = profile.p2p_latency_s + profile.boundary_bytes / profile.p2p_bw
    layer_fwd, layer_bwd = profile.layer_s(tp)
    fwd = n_layers * layer_fwd + (profile.first_fwd_s if first else 0.0)
    bwd = n_layers * layer_bwd + (profile.first_bwd_s if first else 0.0)
    if last:
        fwd += profile.last_fwd_s
        bwd += profile.last_bwd_s
    return fwd + (0.0 if last else p2p), bwd + (0.0 if first else p2p)


def device_params(profile: Profile, n_layers: int, *, first: bool, last: bool, tp: int = 0) -> float:
    """Parameters one device of a stage holds at TP degree ``tp`` (0: the profile's;
    :func:`~chameleon.layout.geometry.per_device`)."""
    return per_device(profile.units, n_layers, first=first, last=last, tp=tp or profile.tp)


def stage_memory(profile: Profile, n_layers: int, *, first: bool, last: bool, in_flight: int) -> float:
    """Eq. 14 for one device of a stage at the profile's TP degree (:func:`chameleon.layout.memory.stage_memory`),
    its gradients synced with peers' (as in any plan of more than one pipeline)."""
    return memory.stage_memory(profile.memory_costs, n_layers, first=first, last=last, in_flight=in_flight, synced=True,
                               tp=profile.tp)


@lru_cache(maxsize=4096)
def one_f_one_b_order(n_stages: int, stage: int, n_micro: int) -> tuple[tuple[bool, int], ...]:
    """The runtime's 1F1B op sequence of ``stage`` (:func:`chameleon.layout.schedule.one_f_one_b`): ``(is_backward, micro)``."""
    return tuple((a.kind == "B", a.micro) for a in one_f_one_b(pipeline=0, stage=stage, n_stages=n_stages, n_micro=n_micro))


def pipeline_time(fwd: Sequence[float], bwd: Sequence[float], n_micro: int) -> float:
    """Eq. 11: the longest path through one pipeline's 1F1B DAG, O(stages · micro-batches).

    An op starts when the previous op on its stage and its data dependency
    (F on the stage above, B on the stage below) have finished. Pure, so remembered:
    the planner, the selector and the simulator ask for the same pipelines again and again.
    """
    return _longest_path(tuple(fwd), tuple(bwd), n_micro)


def forget() -> None:
    """Drop the remembered pipeline times (what a benchmark of a cold search starts from)."""
    _longest_path.cache_clear()


@lru_cache(maxsize=1 << 16)
def _longest_path(fwd: tuple[float, ...], bwd: tuple[float, ...], n_micro: int) -> float:
    n_stages = len(fwd)
    orders = [one_f_one_b_order(n_stages, s, n_micro) for s in range(n_stages)]
    f_end = [[-1.0] * n_micro for _ in range(n_stages)]
    b_end = [[-1.0] * n_micro for _ in range(n_stages)]
    clock, pos = [0.0] * n_stages, [0] * n_stages
    remaining = 2 * n_stages * n_micro
    sweep = list(range(n_stages)) + list(range(n_stages - 1, -1, -1))
    while remaining:
        for s in sweep:
            order, i = orders[s], pos[s]
            while i < len(order):
                is_b, m = order[i]
                if is_b:
                    dep = b_end[s + 1][m] if s + 1 < n_stages else f_end[s][m]
                else:
                    dep = f_end[s - 1][m] if s else 0.0
                if dep < 0:
                    break
                end = max(clock[s], dep) + (bwd[s] if is_b else fwd[s])
                (b_end if is_b else f_end)[s][m] = end
                clock[s] = end
                i += 1
                remaining -= 1
            pos[s] = i
    return max(clock)


Speeds = Mapping[int, float]
"""Slow devices: device → how many times slower it computes than the profile says (absent: 1)."""
EVEN: Speeds = MappingProxyType({})  # every device at the profile's speed


def slowdown(speeds: Speeds, devices: Sequence[int]) -> float:
    """How many times slower a stage on ``devices`` computes: its slowest device's factor (a TP mesh waits for it)."""
    return max((speeds.get(d, 1.0) for d in devices), default=1.0)


def _pipeline_costs(profile: Profile, stages: tuple[Stage, ...], speeds: Speeds = EVEN) -> tuple[list[float], list[float]]:
    """Forward and backward seconds per micro-batch of each stage, at its devices' speed, TP size and recomputation."""
    last = len(stages) - 1
    costs = [stage_cost(profile.under(st.recompute), st.n_layers, first=s == 0, last=s == last, tp=st.tp)
             for s, st in enumerate(stages)]
    factors = [slowdown(speeds, st.devices) for st in stages]
    return [c[0] * f for c, f in zip(costs, factors)], [c[1] * f for c, f in zip(costs, factors)]


def allreduce_time(profile: Profile, group_size: int, params: float) -> float:
    """Ring all-reduce of ``params`` gradient elements per device over ``group_size`` devices."""
    return ring_all_reduce_s(profile.dp_latency_s, profile.dp_bw, params * profile.state.grad, group_size)


def sync_time(profile: Profile, plan: Plan) -> tuple[float, int]:
    """Seconds and rounds of the coloured DP gradient sync of a plan: its geometry's buckets and rounds, each
    round as long as its largest all-reduce."""
    g = geometry_of(plan)
    seconds = sum(max(allreduce_time(profile, *g.sync_size(b, profile.units)) for b in r) for r in g.rounds)
    return seconds, len(g.rounds)


def optimizer_time(profile: Profile, plan: Plan, speeds: Speeds = EVEN) -> float:
    """The slowest device's optimizer step (the most parameters, times its slowdown)."""
    most = max(
        device_params(profile, st.n_layers, first=s == 0, last=s == p.n_stages - 1, tp=st.tp)
        * slowdown(speeds, st.devices)
        for p in plan.pipelines for s, st in enumerate(p.stages) if st.devices
    )
    return most * profile.optimizer_s_per_param


def reroute_extra(profile: Profile, plan: Plan, *, slots: str = "max") -> float:
    """Eq. 12/13: extra 1F1B slots hosts run for device-less stages.

    A lost stage ``i`` of a pipeline with ``m`` micro-batches hands ``⌈m / hosts⌉``
    of them to each host; each costs that stage's ``t_f + t_b``. ``slots=sum`` adds
    the lost stages' extra time (the paper's Eq. 13); ``slots=max`` takes the worst
    stage, because extra slots on different stages run on different devices and
    overlap like the rest of the 1F1B steady state.
    """
    if slots not in REROUTE_SLOTS[1:]:
        raise ValueError(f"policy.reroute_slots={slots!r}: Eq. 13 takes max or sum")
    per_stage: dict[int, float] = {}
    for r in plan.reroutes:
        pipe = plan.pipelines[r.pipeline]
        stage = pipe.stages[r.stage]
        fwd, bwd = stage_cost(profile.under(stage.recompute), stage.n_layers, first=r.stage == 0,
                              last=r.stage == pipe.n_stages - 1)
        extra = math.ceil(pipe.micro_batches / len(r.hosts)) * (fwd + bwd)
        per_stage[r.stage] = per_stage.get(r.stage, 0.0) + extra
    if not per_stage:
        return 0.0
    return sum(per_stage.values()) if slots == "sum" else max(per_stage.values())


def cpu_share(profile: Profile, plan: Plan) -> float:
    """``max(1, (P + n)/C)`` of the busiest node: the stretch when its ``P`` processes are busy on ``C`` cores.

    CPU devices (``profile.host_cores`` > 0) are processes time-sharing their node's
    cores with each other and ``n = profile.background_procs`` busy processes of other
    jobs; gradient sync and the optimizer step keep every process busy at once.
    """
    if not profile.host_cores or not plan.devices:
        return 1.0
    per_node = Counter(d // profile.devices_per_node for d in plan.devices)
    return max(1.0, (max(per_node.values()) + profile.background_procs) / profile.host_cores)


def _op_costs(profile: Profile, plan: Plan, speeds: Speeds = EVEN) -> dict[tuple[str, int, int], float]:
    """Seconds of a forward (``"F"``) or backward (``"B"``) micro-batch of stage ``s`` of pipeline ``j``."""
    out = {}
    for j, p in enumerate(plan.pipelines):
        fwd, bwd = _pipeline_costs(profile, p.stages, speeds)
        for s in range(p.n_stages):
            out["F", j, s], out["B", j, s] = fwd[s], bwd[s]
    return out


def _op_idle(profile: Profile, plan: Plan) -> dict[tuple[str, int, int], float]:
    """Seconds of each op (keyed as :func:`_op_costs`) its processes wait with no thread on a core: its layers'
    TP all-reduces' idle part (:class:`~chameleon.decision.profiler.TPTerms`)."""
    out = {}
    for j, p in enumerate(plan.pipelines):
        for s, st in enumerate(p.stages):
            terms = profile.tp_extra(st.tp or profile.tp)
            out["F", j, s], out["B", j, s] = st.n_layers * terms.fwd_idle_s, st.n_layers * terms.bwd_idle_s
    return out


def _executors(profile: Profile, plan: Plan, *, merged: bool) -> list[tuple[int, int, list[Action]]]:
    """``(node, processes, actions)`` of every TP mesh of the step.

    ``merged``: the runtime's lists (:func:`chameleon.layout.schedule.step_actions`),
    reroute hosts running the rerouted micro-batches between their own. Otherwise
    every stage runs its own pipeline's 1F1B, a device-less one on a node of its own
    (Eq. 12/13 then add the reroute hosts' extra slots).
    """
    if merged:
        meshes: dict[int, tuple[int, list[Action]]] = {}
        width: Counter = Counter()
        for d, actions in step_actions(plan).items():
            meshes.setdefault(id(actions), (d, actions))
            width[id(actions)] += 1
        return [(d // profile.devices_per_node, width[k], actions) for k, (d, actions) in meshes.items()]
    return [
        (st.devices[0] // profile.devices_per_node if st.devices else -1 - j, max(st.tp, 1),
         one_f_one_b(pipeline=j, stage=s, n_stages=p.n_stages, n_micro=p.micro_batches))
        for j, p in enumerate(plan.pipelines) for s, st in enumerate(p.stages)
    ]


def device_work(profile: Profile, plan: Plan) -> dict[int, float]:
    """Seconds each device of ``plan`` computes in a step at the profile's speed: its forwards and backwards, as
    :func:`~chameleon.layout.schedule.step_actions` gives them (a stage's micro-batches on its devices, a rerouted
    stage's on its hosts in turn), counted per stage rather than listed (the core asks at every generation's start),
    waits left out — what its measured compute is judged by."""
    cost = _op_costs(profile, plan)
    work: dict[int, float] = {}
    for j, p in enumerate(plan.pipelines):
        if not p.micro_batches:
            continue
        for s, st in enumerate(p.stages):
            each = cost["F", j, s] + cost["B", j, s]
            runs = Counter({st.devices: p.micro_batches}) if st.devices else Counter(
                executors(plan, j, s, i) for i in range(p.micro_batches))  # a rerouted stage: its hosts, in turn
            for mesh, micro in runs.items():
                for d in mesh:
                    work[d] = work.get(d, 0.0) + micro * each
    return work


def schedule_time(profile: Profile, plan: Plan, speeds: Speeds = EVEN) -> float:
    """The longest path through the runtime's step schedule, every device on a core of its own.

    Each device runs its :func:`~chameleon.layout.schedule.step_actions` list in
    order, an op starting once its input is done; equals the slowest
    :func:`pipeline_time` when nothing is rerouted.
    """
    cost, units = _op_costs(profile, plan, speeds), _executors(profile, plan, merged=True)
    end: dict[Action, float] = {}
    clock, pos = [0.0] * len(units), [0] * len(units)
    remaining = sum(len(actions) for _, _, actions in units)
    while remaining:
        for u, (_, _, actions) in enumerate(units):
            while pos[u] < len(actions):
                action = actions[pos[u]]
                dep = dependency(plan, action)
                if dep is not None and dep not in end:
                    break
                clock[u] = end[action] = max(clock[u], end.get(dep, 0.0)) + cost[action.kind, action.pipeline, action.stage]
                pos[u] += 1
                remaining -= 1
    return max(clock, default=0.0)


def shared_compute(profile: Profile, plan: Plan, *, merged: bool = True, speeds: Speeds = EVEN) -> float:
    """The 1F1B phase of every device at once when processes share their node's cores.

    A processor-sharing simulation: each TP mesh runs its ops in order (see
    :func:`_executors` for ``merged``) once their inputs are done, and while ``n``
    processes on a node with ``C`` cores run ops, each progresses at
    ``min(1, C/(n + background))`` (``profile.background_procs`` of other jobs); a
    waiting process uses no core — between ops, and for the idle part of an op's TP
    all-reduces (:func:`_op_idle`), which runs after its work at full speed. Equals
    :func:`schedule_time` when no node has more busy processes than cores.
    """
    cost, idle = _op_costs(profile, plan, speeds), _op_idle(profile, plan)
    units = _executors(profile, plan, merged=merged)
    done: set[Action] = set()
    pos = [0] * len(units)
    left: dict[int, list[float]] = {}  # unit -> [work, idle seconds] left of its running op
    now = 0.0
    while True:
        for u, (_, _, actions) in enumerate(units):
            if u in left or pos[u] == len(actions):
                continue
            action = actions[pos[u]]
            dep = dependency(plan, action)
            if dep is None or dep in done:
                key = action.kind, action.pipeline, action.stage
                wait = min(idle[key], cost[key])
                left[u] = [cost[key] - wait, wait]
        if not left:
            return now
        busy: Counter = Counter()
        for u, (work, _) in left.items():
            busy[units[u][0]] += units[u][1] if work > 0 else 0
        rate = {u: min(1.0, profile.host_cores / (busy[units[u][0]] + profile.background_procs)) if work > 0 else 1.0
                for u, (work, _) in left.items()}
        step = min((work or wait) / rate[u] for u, (work, wait) in left.items())
        now += step
        tiny = 1e-12 * max(1.0, now)
        for u in list(left):
            phase = 0 if left[u][0] > 0 else 1
            left[u][phase] -= step * rate[u]
            if left[u][phase] <= tiny:
                left[u][phase] = 0.0
                if phase == 1 or left[u][1] <= tiny:
                    done.add(units[u][2][pos[u]])
                    pos[u] += 1
                    del left[u]


def estimate_step(profile: Profile, plan: Plan, *, reroute_slots: str = "schedule", speeds: Speeds = EVEN) -> StepEstimate:
    """Estimated step time of ``plan`` (Eqs. 10–13 plus p2p, DP sync, optimizer, the commit and CPU sharing).

    ``reroute_slots=schedule`` times rerouted plans by the runtime's own schedule
    (:func:`schedule_time`); ``max`` and ``sum`` add Eq. 12/13's extra slots instead.
    ``speeds``: slow devices (:data:`Speeds`).
    """
    if reroute_slots not in REROUTE_SLOTS:
        raise ValueError(f"policy.reroute_slots={reroute_slots!r}: use schedule, max or sum")
    by_shape: dict[tuple, float] = {}  # pipelines of one shape (and speed) take the same time
    times = []
    for p in plan.pipelines:
        shape = (tuple((st.n_layers, st.recompute, slowdown(speeds, st.devices)) for st in p.stages), p.micro_batches)
        if shape not in by_shape:
            by_shape[shape] = pipeline_time(*_pipeline_costs(profile, p.stages, speeds), p.micro_batches)
        times.append(by_shape[shape])
    merged = reroute_slots == "schedule"
    if not plan.reroutes:
        compute, extra = max(times), 0.0
    elif merged:
        compute, extra = schedule_time(profile, plan, speeds), 0.0
    else:
        compute, extra = max(times), reroute_extra(profile, plan, slots=reroute_slots)
    sync, rounds = sync_time(profile, plan)
    opt = optimizer_time(profile, plan, speeds)
    fixed = profile.commit_s
    if not profile.host_cores:
        return StepEstimate(compute + extra + sync + opt + fixed, compute, extra, sync, opt, rounds, tuple(times))
    share, shared = cpu_share(profile, plan), shared_compute(profile, plan, merged=merged, speeds=speeds)
    return StepEstimate(
        shared + share * (extra + sync + opt) + fixed, compute, extra, sync, opt, rounds, tuple(times), share, shared
    )


def rebalanced(profile: Profile, plan: Plan, speeds: Speeds) -> Plan:
    """``plan`` with its micro-batches split over its pipelines by their speed: each pipeline keeps at least one,
    and each of the rest goes where it lengthens the slowest pipeline least (no state moves: the same stages on
    the same devices). A rerouted plan keeps its split (its hosts' schedules interleave)."""
    if plan.reroutes or len(plan.pipelines) < 2:
        return plan
    costs = [_pipeline_costs(profile, p.stages, speeds) for p in plan.pipelines]
    counts = [1] * len(plan.pipelines)
    longer = [(pipeline_time(*c, 2), j) for j, c in enumerate(costs)]  # each pipeline's time with one more
    heapq.heapify(longer)
    for _ in range(plan.n_micro_batches - len(counts)):
        _, j = heapq.heappop(longer)
        counts[j] += 1
        heapq.heappush(longer, (pipeline_time(*costs[j], counts[j] + 1), j))
    pipelines = tuple(replace(p, micro_batches=m) for p, m in zip(plan.pipelines, counts))
    return replace(plan, pipelines=pipelines)


def symmetric_step(n_stages: int, n_micro: int, fwd: float, bwd: float) -> float:
    """Eq. 9: ``(N_pp + N_m − 1)·(t_f + t_b)`` for uniform stages."""
    return (n_stages + n_micro - 1) * (fwd + bwd)


_last_memory: tuple = (None, None, {})  # (profile, plan, its memory): a candidate's fit, then its peak, ask twice


def memory_per_device(profile: Profile, plan: Plan) -> dict[int, float]:
    """Eq. 14 per device (:func:`chameleon.layout.memory.plan_memory` with the profile's costs); the last plan's
    is kept (read it, never change it)."""
    global _last_memory
    known_profile, known_plan, known = _last_memory
    if known_plan is not plan or known_profile is not profile:
        known = memory.plan_memory(profile.memory_costs, plan)
        _last_memory = (profile, plan, known)
    return known


def fits(profile: Profile, plan: Plan) -> bool:
    """Whether every device of ``plan`` has the memory Eq. 14 says it needs."""
    return max(memory_per_device(profile, plan).values()) <= profile.memory_bytes


def recomputed_to_fit(profile: Profile, plan: Plan) -> Plan:
    """``plan`` with every stage under the least recomputation, from the job's on (none, selective, full:
    :attr:`~chameleon.decision.profiler.Profile.leaner`), whose Eq. 14 memory fits — the most the profile prices
    where none does (:func:`fits` then says no) — and every rerouted stage under the most its hosts use (they run
    its micro-batches): recomputation, and its rerun forward, only where memory needs it."""
    modes = profile.leaner
    if all(st.recompute == modes[0] for p in plan.pipelines for st in p.stages) and fits(profile, plan):
        return plan  # the job's recomputation fits everywhere: the common case, at the price of one memory count
    need = {mode: memory_per_device(profile, recomputing(plan, lambda j, s, mode=mode: mode)) for mode in modes}
    chosen = {
        (j, s): next((mode for mode in modes if need[mode][st.devices[0]] <= profile.memory_bytes), modes[-1])
        for j, p in enumerate(plan.pipelines) for s, st in enumerate(p.stages) if st.devices
    }
    for r in plan.reroutes:
        chosen[r.pipeline, r.stage] = max((chosen[h, r.stage] for h in r.hosts), key=modes.index)
    return recomputing(plan, lambda j, s: chosen[j, s])


def migration_time(profile: Profile, old: Plan, new: Plan) -> tuple[float, float]:
    """Seconds and total bytes to give every device of ``new`` the state it lacks.

    A device receives the weights and AdamW moments of every region of ``new`` it did
    not hold under ``old`` (:meth:`~chameleon.layout.geometry.Geometry.lacking`), from
    survivors usually on another node; receivers run concurrently, so time is the
    busiest receiver's bytes ÷ the DP (inter-node) bandwidth plus one latency per unit.
    """
    lacking = geometry_of(new).lacking(geometry_of(old), profile.units)
    moved = {d: elems * profile.state.moved for d, (elems, _) in lacking.items()}
    worst = max((units * profile.dp_latency_s + moved[d] / profile.dp_bw for d, (_, units) in lacking.items()), default=0.0)
    return worst, sum(moved.values())


def checkpoint_time(profile: Profile, n_layers: int) -> float:
    """Writing or reading a whole checkpoint (weights + optimizer state) at the checkpoint bandwidth."""
    total = n_layers * profile.layer_params + profile.first_params + profile.last_params
    return total * profile.state.moved / profile.checkpoint_bw


def rebuild_time(profile: Profile, plan: Plan) -> float:
    """Creating the new generation's groups, as the runtime does.

    A device builds, one after another, each sync bucket and TP group it belongs to and a
    pair group with each neighbouring stage it exchanges activations with (a generation
    has no world group); devices with disjoint groups connect at the same time. So the
    rebuild costs the busiest stage's group count, not the total. Groups a growth keeps
    unchanged are still counted (an upper bound).
    """
    g = geometry_of(plan)
    neighbours = [(s > 0) + (s < p.n_stages - 1) for p in plan.pipelines for s, st in enumerate(p.stages) if st.devices]
    busiest = max((sum(len(g.buckets[b].stages) > 1 for b in buckets) + (st.tp > 1) + n
                   for st, buckets, n in zip(g.stages, g.of_stage, neighbours)), default=0)
    return busiest * profile.group_create_s
