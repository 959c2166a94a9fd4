"""Eq. 8: choose how to recover from a fault.

Candidates: ``reroute`` (orphan micro-batches to same-stage DP peers),
``dynamic`` (the planner's best plan on the survivors), ``redundant`` (the dead
stage's layers move onto a pipeline neighbour, weights from a DP peer), ``reform``
(the survivors of a broken TP group re-formed at a smaller TP size, its layers kept or
over more stages, the state they lack from other replicas) and ``checkpoint`` (reload the newest checkpoint onto the planner's plan). Each is
scored ``B / t_step · (D − T − p·C) / D``: Eq. 8's average throughput until the
next fault, less what that fault is expected to cost on the candidate's plan —
``p`` the share of fault domains whose loss would leave some region of the state
with no holder (:meth:`~chameleon.layout.geometry.Geometry.exposure`), ``C`` the training time such a loss throws away: a
restart, a reload and the progress since the newest checkpoint, or everything
since the start when there is none (:func:`fault_cost_s`). With ``p = 0`` it is
Eq. 8. The best feasible candidate wins; ties go to the smaller transition, then
the name. A candidate over memory recomputes activations on the stages that need it (selective, then full:
:func:`~chameleon.decision.estimator.recomputed_to_fit`) before it is refused, and is priced with the rerun
forwards. What survives is decided region by region (:mod:`chameleon.layout.geometry`):
a layer lives while each of its TP shards has a live holder, whichever replica that
is, and survivors of broken stages are regrouped into units a re-plan may use.
Re-planning weighs the planner's best plan, its best with every layer
on two pipelines, its best on fewer devices (the rest idle) and the plans that
ran earlier in the run on devices alive again. ``t_step`` is measured where a
plan of the same shape ran, and estimated on the measured scale elsewhere
(:mod:`chameleon.decision.measured`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields, replace

from chameleon.decision import estimator as est
from chameleon.decision.config import Policy, PolicyConfig
from chameleon.decision.measured import Measured
from chameleon.decision.planner import Planner, Precomputed, precompute
from chameleon.decision.profiler import Profile
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import Pipeline, Plan, PlanError, Reroute, Stage, split_layers, validate_plan
from chameleon.layout.rendezvous import rendezvous_fault


@dataclass(frozen=True)
class Candidate:
    """One recovery option and its estimates (seconds, bytes)."""

    name: str
    feasible: bool
    why: str = ""
    plan: Plan | None = None
    t_step: float = math.inf
    transition: float = math.inf
    transition_parts: dict[str, float] = field(default_factory=dict)
    peak_memory: float = 0.0
    exposure: float = 0.0
    fault_cost_s: float = 0.0
    score: float = -math.inf

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        out["transition_parts"] = dict(self.transition_parts)
        out["plan"] = None if self.plan is None else {"summary": self.plan.describe(), **self.plan.to_dict()}
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in out.items()}


@dataclass(frozen=True)
class Decision:
    """What the selector chose, every candidate it weighed, and the ``D`` it used."""

    policy: str
    failed: tuple[int, ...]
    d_s: float
    d_source: str
    choice: str | None
    candidates: tuple[Candidate, ...]
    note: str = ""

    def table(self) -> str:
        """Every candidate as a row: feasibility, estimated step time, transition, peak memory, score."""
        head = (f"{'candidate':<11} {'ok':<3} {'t_step s':>10} {'transition s':>13} {'peak GB':>8} {'risk p':>7} "
                f"{'cost s':>9} {'score':>10}  note")
        rows = [head, "-" * len(head)]
        for c in self.candidates:
            mark = "→" if c.name == self.choice else " "
            rows.append(
                f"{mark}{c.name:<10} {'yes' if c.feasible else 'no':<3} {_fmt(c.t_step, '10.3f')} "
                f"{_fmt(c.transition, '13.3f')} {c.peak_memory / 1e9:8.1f} {c.exposure:7.3f} {c.fault_cost_s:9.1f} "
                f"{_fmt(c.score, '10.3f')}  {c.why}"
            )
        return "\n".join(rows)

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.name == self.choice), None)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "candidates"}
        out["candidates"] = [c.to_dict() for c in self.candidates]
        return out


def _fmt(value: float, spec: str) -> str:
    return format("—", f">{spec.split('.')[0]}") if math.isinf(value) else format(value, spec)


def estimate_d(policy: PolicyConfig, *, fault_times: list[float], elapsed_s: float) -> tuple[float, str]:
    """Expected time to the next fault.

    ``policy.fixed_d_s`` if set. Otherwise faults are a Poisson process whose rate
    has a Gamma prior worth ``prior_faults`` faults in ``prior_faults · mtbf_prior_s``
    seconds; after ``n`` faults in ``elapsed_s`` the posterior mean rate is
    ``(prior_faults + n) / (prior_faults · mtbf + elapsed_s)`` and D is its inverse.
    """
    if policy.fixed_d_s is not None:
        return policy.fixed_d_s, "fixed by policy.fixed_d_s"
    n = len(fault_times)
    alpha = policy.prior_faults + n
    beta = policy.prior_faults * policy.mtbf_prior_s + elapsed_s
    return beta / alpha, (
        f"Gamma–Poisson posterior: prior MTBF {policy.mtbf_prior_s:.0f} s worth {policy.prior_faults:g} faults, "
        f"{n} faults observed in {elapsed_s:.0f} s"
    )


def score(*, global_batch: int, t_step: float, transition: float, d_s: float) -> float:
    """Eq. 8: samples per second averaged over the window until the next fault."""
    return global_batch / t_step * (d_s - transition) / d_s


@dataclass(frozen=True)
class Fallback:
    """What the next fault would cost where it leaves some region of the state with no holder.

    ``checkpoint_age_s``: age of the newest checkpoint now (None: none exists, so
    such a fault ends the run: everything since the start is lost);
    ``checkpoint_interval_s``: seconds between checkpoints (None: no more come);
    ``elapsed_s``: training time so far; ``domains``: device groups that fail
    together, each equally likely to be next (None: every device alone);
    ``in_process``: a reload rebuilds groups instead of restarting the job.
    """

    checkpoint_age_s: float | None = None
    checkpoint_interval_s: float | None = None
    elapsed_s: float = 0.0
    domains: tuple[tuple[int, ...], ...] | None = None
    in_process: bool = False


def expected_age(age_s: float, interval_s: float | None, d_s: float) -> float:
    """Expected age of the newest checkpoint when the next fault strikes, faults Poisson with mean gap ``d_s``.

    A checkpoint ``age_s`` old now and one every ``interval_s`` from then on: with
    ``λ = 1/d_s`` and ``L = interval_s − age_s`` (time to the next write, ≥ 0),
    ``E = a(1 − e^{−λL}) + 1/λ − (L + 1/λ)e^{−λL} + e^{−λL}·(1/λ − I·e^{−λI}/(1 − e^{−λI}))``;
    with no further checkpoint it is ``age_s + d_s``.
    """
    if interval_s is None:
        return age_s + d_s
    rate, gap = 1 / d_s, max(interval_s - age_s, 0.0)
    reach = math.exp(-rate * gap)
    within = age_s * (1 - reach) + d_s - (gap + d_s) * reach
    periodic = d_s - interval_s * math.exp(-rate * interval_s) / -math.expm1(-rate * interval_s)
    return within + reach * periodic


def fault_cost_s(profile: Profile, plan: Plan, fallback: Fallback, d_s: float) -> float:
    """Training time lost when the next fault leaves some region of ``plan``'s state with no holder.

    A reload (restart or group rebuild, reading the checkpoint) plus the expected
    progress since the newest checkpoint; with no checkpoint, the whole run so far
    and the window ahead (the job cannot go on).
    """
    if fallback.checkpoint_age_s is None:
        return fallback.elapsed_s + d_s
    restart = est.rebuild_time(profile, plan) if fallback.in_process else profile.restart_s
    age = expected_age(fallback.checkpoint_age_s, fallback.checkpoint_interval_s, d_s)
    return restart + est.checkpoint_time(profile, plan.n_layers) + age


def risk_score(*, global_batch: int, t_step: float, transition: float, d_s: float, exposure: float, cost_s: float) -> float:
    """Eq. 8 less the expected cost of the next fault: ``B / t_step · (D − T − p·C) / D``."""
    return score(global_batch=global_batch, t_step=t_step, transition=transition + exposure * cost_s, d_s=d_s)


def _lost_units(plan: Plan, failed: set[int]) -> list[tuple[int, int]]:
    return [(j, s) for j, p in enumerate(plan.pipelines) for s, st in enumerate(p.stages) if failed & set(st.devices)]


def reroute_plan(plan: Plan, failed: set[int]) -> Plan:
    """Empty every stage with a failed device and reroute its micro-batches to same-stage peers.

    Stages already empty (rerouted by an earlier fault) stay empty and are rerouted
    again over the peers that are still live.

    Raises:
        PlanError: When a lost stage has no live peer with the same layers.
    """
    empty = {(j, s) for j, p in enumerate(plan.pipelines) for s, st in enumerate(p.stages) if not st.devices}
    lost = set(_lost_units(plan, failed)) | empty
    pipelines, reroutes = [], []
    for j, p in enumerate(plan.pipelines):
        stages = tuple(replace(st, devices=()) if (j, s) in lost else st for s, st in enumerate(p.stages))
        pipelines.append(Pipeline(stages=stages, micro_batches=p.micro_batches))
    for j, s in sorted(lost):
        layers = plan.pipelines[j].stages[s].layers
        hosts = tuple(
            h for h, p in enumerate(plan.pipelines)
            if (h, s) not in lost and s < p.n_stages and p.stages[s].layers == layers
        )
        if not hosts:
            raise PlanError(f"pipeline {j} stage {s} (layers {layers}) has no surviving same-stage peer to reroute to")
        reroutes.append(Reroute(pipeline=j, stage=s, hosts=hosts))
    out = Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=tuple(pipelines), reroutes=tuple(reroutes))
    validate_plan(out)
    return out


def takeover_plan(profile: Profile, plan: Plan, failed: set[int]) -> Plan:
    """Merge each lost stage into a pipeline neighbour (the faster result that fits in memory, recomputing where it
    must).

    Lost stages are merged last first, so a merge never shifts the index of a lost
    stage still to come; two lost stages of one pipeline may end up in one neighbour.

    Raises:
        PlanError: When a lost stage has no neighbour or no merge fits in memory.
    """
    pipelines = list(plan.pipelines)
    for j, s in sorted(_lost_units(plan, failed), reverse=True):
        p = pipelines[j]
        lost = p.stages[s]
        options, neighbours = [], 0
        for nb in (s - 1, s + 1):
            if not 0 <= nb < p.n_stages or failed & set(p.stages[nb].devices) or not p.stages[nb].devices:
                continue
            neighbours += 1
            lo, hi = min(lost.layers[0], p.stages[nb].layers[0]), max(lost.layers[1], p.stages[nb].layers[1])
            merged = replace(p.stages[nb], layers=(lo, hi))
            stages = tuple(merged if i == nb else st for i, st in enumerate(p.stages) if i != s)
            trial = est.recomputed_to_fit(profile, Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size,
                                                        pipelines=(Pipeline(stages=stages, micro_batches=p.micro_batches),)))
            if est.fits(profile, trial):
                options.append((est.estimate_step(profile, trial).compute, nb, trial.pipelines[0]))
        if not options:
            why = "no live neighbour can take its layers within memory" if neighbours else "no live neighbour"
            raise PlanError(f"pipeline {j} stage {s}: {why}")
        pipelines[j] = min(options, key=lambda o: o[:2])[2]
    out = Plan(n_layers=plan.n_layers, micro_batch_size=plan.micro_batch_size, pipelines=tuple(pipelines))
    validate_plan(out)
    return out


def reform_plans(profile: Profile, plan: Plan, failed: set[int], tp_sizes: Collection[int]) -> list[Plan]:
    """The plans that re-form every pipeline which lost devices of its TP groups from its survivors
    (:func:`reform_options`, within memory, recomputing where they must): each broken pipeline as its first option
    (its layers kept where its stages can: the least moved), and each as the option that gives the whole plan the
    shortest estimated step. The selector weighs both by Eq. 8.

    Raises:
        PlanError: When no broken pipeline can be re-formed (or the plan is rerouted).
    """
    if plan.reroutes:
        raise PlanError("a rerouted plan is re-planned, not re-formed")
    dead = set(failed)
    kept = [p for p in plan.pipelines if not dead & set(p.devices)]
    least, fastest = list(kept), list(kept)
    for p in (p for p in plan.pipelines if dead & set(p.devices)):
        options = [o for o in reform_options(plan.n_layers, p, dead, tp_sizes)
                   if est.fits(profile, _whole(profile, plan, (*kept, o)))]
        if options:
            least.append(options[0])
            fastest.append(min(options, key=lambda o: est.estimate_step(profile, _whole(profile, plan, (*fastest, o))).t_step))
    if len(least) == len(kept):
        raise PlanError("no broken TP group's survivors fill a TP size the model allows within memory")
    return list(dict.fromkeys(_whole(profile, plan, pipelines) for pipelines in (least, fastest)))


def _whole(profile: Profile, plan: Plan, pipelines) -> Plan:
    """``pipelines`` (some of ``plan``'s, some re-formed) as a plan of its batch, the micro-batches split by speed,
    stages recomputing where their memory needs it."""
    shares = [p.micro_batches for p in pipelines]
    shares[0] += plan.n_micro_batches - sum(shares)
    out = replace(plan, pipelines=tuple(replace(p, micro_batches=m) for p, m in zip(pipelines, shares)))
    validate_plan(out)
    return est.recomputed_to_fit(profile, est.rebalanced(profile, out, est.EVEN))


def reform_options(n_layers: int, pipeline: Pipeline, dead: set[int], tp_sizes: Collection[int]) -> list[Pipeline]:
    """The pipelines ``pipeline``'s survivors can re-form: its layers kept at the largest size of ``tp_sizes`` (the
    TP sizes the model allows) every stage's survivors fill, then, for each size, as many even stages as all its
    survivors fill (a smaller TP size on more stages puts each survivor to work). Device ``j`` of a new stage is a
    survivor whose old shard lies in new shard ``j`` where one does (it then lacks the least)."""
    old = {d: (t, len(st.devices)) for st in pipeline.stages for t, d in enumerate(st.devices)}
    survivors = [[d for d in st.devices if d not in dead] for st in pipeline.stages]
    options = []
    width = max((t for t in tp_sizes if t <= min(map(len, survivors))), default=0)
    if width:
        options.append(tuple(Stage(_reformed(old, alive, width), st.layers) for st, alive in zip(pipeline.stages, survivors)))
    everyone = [d for alive in survivors for d in alive]
    for t in sorted(tp_sizes, reverse=True):
        k = min(len(everyone) // t, n_layers)
        if k:
            bounds = split_layers(n_layers, k)
            options.append(tuple(Stage(_reformed(old, everyone[i * t:(i + 1) * t], t), bounds[i]) for i in range(k)))
    return [Pipeline(stages, pipeline.micro_batches) for stages in dict.fromkeys(options)]


def _reformed(old: dict[int, tuple[int, int]], alive: list[int], width: int) -> tuple[int, ...]:
    """``width`` of ``alive`` devices in new-shard order: for shard ``j``, one whose old shard (``old[d]``: its
    index and its stage's width) lies in it."""
    free, out = list(alive), []
    for j in range(width):
        inside = [d for d in free if j * old[d][1] <= old[d][0] * width < (j + 1) * old[d][1]]
        out.append((inside or free)[0])
        free.remove(out[-1])
    return tuple(out)


IDLE_OPTIONS = 4  # re-planning also weighs the best plans on up to this many fewer stage units
IDLE_UNITS = 256  # ... on clusters of at most this many: beyond, a unit is under 0.4 % of the work


def _finish(name: str, profile: Profile, plan: Plan, parts: dict[str, float], *, global_batch: int, d_s: float, slots: str,
            fallback: Fallback, measured: Measured, speeds: est.Speeds = est.EVEN, tagless: bool = False) -> Candidate:
    """The candidate of moving to ``plan`` (recomputing where its memory needs it) after ``parts``, scored; infeasible
    where it does not fit even so, or its transition outlasts ``D``, or — on a ``tagless`` backend (NCCL, HCCL) — its
    reroutes would mismatch or deadlock point-to-point messages (a plan without reroutes never does)."""
    unsafe = rendezvous_fault(plan) if tagless and plan.reroutes else None
    if unsafe:
        return Candidate(name, False, f"not on this backend: {unsafe}", plan)
    plan = est.recomputed_to_fit(profile, plan)
    t_step = measured.step_s(plan, est.estimate_step(profile, plan, reroute_slots=slots, speeds=speeds).t_step)
    peak = max(est.memory_per_device(profile, plan).values())
    transition = sum(parts.values())
    p = geometry_of(plan).exposure(fallback.domains)
    cost = fault_cost_s(profile, plan, fallback, d_s) if p else 0.0
    risk = dict(exposure=p, fault_cost_s=cost)
    if peak > profile.memory_bytes:
        return Candidate(name, False, f"needs {peak / 1e9:.1f} GB > {profile.memory_bytes / 1e9:.1f} GB per device",
                         plan, t_step, transition, parts, peak, **risk)
    if d_s <= transition:
        return Candidate(name, False, f"D = {d_s:.1f} s ≤ transition {transition:.1f} s", plan, t_step, transition, parts,
                         peak, **risk)
    return Candidate(name, True, "", plan, t_step, transition, parts, peak, **risk,
                     score=risk_score(global_batch=global_batch, t_step=t_step, transition=transition, d_s=d_s,
                                      exposure=p, cost_s=cost))


def _best(options: list[Candidate]) -> Candidate:
    """The highest-scoring feasible option (ties: the smaller transition), else the first."""
    feasible = [c for c in options if c.feasible]
    return min(feasible, key=lambda c: (-c.score, c.transition)) if feasible else options[0]


RelayoutPeak = Callable[[Plan], float]
"""The most bytes any device needs while the state moves onto a plan (old state, new shards and packed buffers at
once: :func:`chameleon.layout.memory.relayout_memory`); the caller knows the tensors, the selector only plans."""


def _relayout_check(profile: Profile, plan: Plan, peak: RelayoutPeak | None) -> Callable[[Candidate], str]:
    """Why a candidate's re-layout from ``plan`` would run out of memory ('' where it fits). A reload from a
    checkpoint and staying on ``plan`` move no state; without ``peak`` nothing is checked."""
    def why(c: Candidate) -> str:
        if peak is None or c.name == "checkpoint" or c.plan == plan:
            return ""
        need = peak(c.plan)
        return (f"its re-layout needs {need / 1e9:.1f} GB > {profile.memory_bytes / 1e9:.1f} GB per device at its "
                "peak (old state, new shards and packed buffers at once)" if need > profile.memory_bytes else "")
    return why


def _fit_relayout(cands: Sequence[Candidate], pick: Callable[[list[Candidate]], Candidate | None],
                  why: Callable[[Candidate], str]) -> tuple[Candidate | None, tuple[Candidate, ...]]:
    """``pick``'s choice among ``cands``, picked again without it, made infeasible, while its re-layout does not fit
    (``why`` says so); the candidates as weighed. Only the chosen is checked: its manifest is the one the run needs."""
    cands = list(cands)
    while (best := pick(cands)) is not None and best.feasible and (reason := why(best)):
        cands = [replace(c, feasible=False, why=reason, score=-math.inf) if c is best else c for c in cands]
    return best, tuple(cands)


def replans(planner: Planner, units: list[tuple[int, ...]], *, n_micro: int, micro_batch_size: int,
            previous: Plan | None, precomputed: Plan | None = None,
            domains: tuple[tuple[int, ...], ...] | None = None,
            measured: Measured = Measured()) -> list[tuple[Plan, float]]:
    """The plans a re-plan onto ``units`` weighs, each with its search time.

    The planner's best (``precomputed`` when given), placed to move the least
    state from ``previous``; on at most :data:`IDLE_UNITS` units, its best on up to
    :data:`IDLE_OPTIONS` fewer (the last ones idle), so more devices never mean a
    slower plan; when the best leaves some layer exposed to a fault of one of
    ``domains`` (:func:`exposure`), its best with every layer on two pipelines,
    placed, and laid out in device order (each pipeline on neighbouring devices,
    so a node's fault takes as few as it can); and every plan of ``measured`` that
    ran on devices all among ``units``.
    """
    def best(p: Planner, us: list[tuple[int, ...]], prev: Plan | None) -> list[tuple[Plan, float]]:
        try:
            result = p.best(us, n_micro=n_micro, micro_batch_size=micro_batch_size, previous=prev)
        except PlanError:
            return []
        return [(result.plan, result.search_s)]

    out = [(precomputed, 0.0)] if precomputed is not None else best(planner, units, previous)
    ordered = sorted(units)
    if len(units) <= IDLE_UNITS:
        for k in range(1, min(IDLE_OPTIONS, len(units) - 1) + 1):
            out += best(planner, ordered[:-k], previous)
    if len(units) > 1 and (not out or geometry_of(out[0][0]).exposure(domains) > 0):
        out += best(planner.replicated, units, previous) + best(planner.replicated, ordered, None)
    return out + [(plan, 0.0) for plan in measured.plans_on({d for unit in units for d in unit})]


def precompute_replans(plan: Plan, planner: Planner, losses, back: Collection[int] = ()) -> Precomputed:
    """:func:`~chameleon.decision.planner.precompute` (after ``losses``, and with the devices ``back``), and the
    searches :func:`replans` adds on up to :data:`IDLE_UNITS` units (the best on fewer units, the best of two
    pipelines or more), so the planner holds them cached and the likely next fault or growth needs no search."""
    ahead = precompute(plan, planner, losses, back)
    for left in ahead.shapes:
        if left <= IDLE_UNITS:
            for k in range(1, min(IDLE_OPTIONS, left - 1) + 1):
                planner.search(left - k, plan.n_micro_batches)
            planner.replicated.search(left, plan.n_micro_batches)
    return ahead


def candidates(
    profile: Profile,
    plan: Plan,
    failed: set[int],
    *,
    planner: Planner,
    d_s: float,
    slots: str = "max",
    checkpoint_age_s: float | None = None,
    precomputed: Plan | None = None,
    in_process: bool = False,
    fallback: Fallback | None = None,
    idle: Collection[int] = (),
    measured: Measured = Measured(),
    tp_sizes: Collection[int] = (),
    speeds: est.Speeds = est.EVEN,
    tagless: bool = False,
) -> list[Candidate]:
    """Every recovery candidate for ``failed`` devices of ``plan``, feasible or not (with why).

    ``in_process``: survivors reload a checkpoint without restarting (Chameleon's
    runtime), so that candidate pays a group rebuild instead of a job restart.
    ``fallback``: what the next fault would cost (its checkpoint age and in-process
    flag are taken from the arguments above). ``idle``: live devices ``plan``
    leaves idle; a re-plan or a reload may use them, and the survivors of broken
    stages, regrouped into units (:meth:`~chameleon.layout.geometry.Geometry.units`).
    ``measured``: step times measured in this run. ``tp_sizes``: the TP sizes the model allows; given, broken TP
    groups may be re-formed at a smaller one (``reform``). ``speeds``: devices known to be slow (every plan is
    estimated at their pace). ``tagless``: the backend ignores tags and buffers no send (NCCL, HCCL): a plan whose
    point-to-point traffic would mismatch or deadlock there is infeasible (:mod:`chameleon.layout.rendezvous`).
    """
    fallback = replace(fallback or Fallback(), checkpoint_age_s=checkpoint_age_s, in_process=in_process)
    geometry = geometry_of(plan)
    lost = geometry.lost(failed)
    common = dict(global_batch=plan.global_batch, d_s=d_s, slots=slots, fallback=fallback, measured=measured,
                  speeds=speeds, tagless=tagless)
    units = geometry.units((set(plan.devices) - set(failed)) | set(idle))
    options = (lambda: replans(planner, units, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size,
                               previous=plan, precomputed=precomputed, domains=fallback.domains,
                               measured=measured)) if units else list
    builders = {
        "reroute": lambda: _reroute(profile, plan, failed, **common),
        "dynamic": lambda: _dynamic(profile, plan, options(), **common),
        "redundant": lambda: _redundant(profile, plan, failed, **common),
    }
    if tp_sizes and geometry.width > 1:
        builders["reform"] = lambda: _best([_moved("reform", profile, plan, new, {}, **common)
                                            for new in reform_plans(profile, plan, failed, tp_sizes)])
    out = [Candidate(name, False, f"no survivor holds {geometry.describe(lost)}") if lost else _built(name, build)
           for name, build in builders.items()]
    out.append(_built("checkpoint", lambda: _checkpoint(profile, plan, units, planner, precomputed=precomputed, **common)))
    return out


def _built(name: str, build) -> Candidate:
    """``build()``; a candidate that cannot be built is infeasible with the reason, never an error of the caller."""
    try:
        return build()
    except PlanError as err:
        return Candidate(name, False, str(err))
    except Exception as err:  # noqa: BLE001 - a broken candidate must not take the controller down
        return Candidate(name, False, f"could not be built: {type(err).__name__}: {err}")


def _reroute(profile, plan, failed, **common) -> Candidate:
    rr = reroute_plan(plan, failed)
    return _finish("reroute", profile, rr, {"rebuild": est.rebuild_time(profile, rr)}, **common)


def _dynamic(profile, plan, options, **common) -> Candidate:
    if not options:
        raise PlanError("no device survives to re-plan onto")
    return _best([_moved("dynamic", profile, plan, new, {"search": search_s}, **common) for new, search_s in options])


def _moved(name: str, profile: Profile, old: Plan, new: Plan, parts: dict[str, float], **common) -> Candidate:
    """``new`` reached from ``old`` by migrating state and rebuilding groups (after ``parts``)."""
    migrate, _ = est.migration_time(profile, old, new)
    return _finish(name, profile, new, {**parts, "migrate": migrate, "rebuild": est.rebuild_time(profile, new)}, **common)


def _redundant(profile, plan, failed, **common) -> Candidate:
    to = takeover_plan(profile, plan, failed)
    return _moved("redundant", profile, plan, to, {}, **common)


def _checkpoint(profile, plan, units, planner, *, precomputed, fallback, measured, **common) -> Candidate:
    if fallback.checkpoint_age_s is None:
        return Candidate("checkpoint", False, "no checkpoint exists")
    if not units:
        return Candidate("checkpoint", False, "no device survives to reload it onto")
    options = replans(planner, units, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size,
                      previous=None, precomputed=precomputed, domains=fallback.domains, measured=measured)
    if not options:
        raise PlanError("no plan to reload it onto")
    reloaded = replace(fallback, checkpoint_age_s=0.0)  # after the reload, the checkpoint is the state trained on
    out = []
    for target, _ in options:
        restart = {"rebuild": est.rebuild_time(profile, target)} if fallback.in_process else {"restart": profile.restart_s}
        parts = {**restart, "reload": est.checkpoint_time(profile, plan.n_layers), "lost_progress": fallback.checkpoint_age_s}
        out.append(_finish("checkpoint", profile, target, parts, fallback=reloaded, measured=measured, **common))
    return _best(out)


def decide(
    profile: Profile,
    plan: Plan,
    failed: set[int],
    *,
    policy: PolicyConfig,
    planner: Planner,
    fault_times: list[float] = (),
    elapsed_s: float = 0.0,
    checkpoint_age_s: float | None = None,
    checkpoint_interval_s: float | None = None,
    domains: tuple[tuple[int, ...], ...] | None = None,
    precomputed: Plan | None = None,
    in_process: bool = False,
    idle: Collection[int] = (),
    measured: Measured = Measured(),
    tp_sizes: Collection[int] = (),
    speeds: est.Speeds = est.EVEN,
    tagless: bool = False,
    relayout_peak: RelayoutPeak | None = None,
) -> Decision:
    """Weigh every candidate by Eq. 8 and the next fault's cost, and choose; a forced ``policy.name`` restricts the choice.

    ``checkpoint_interval_s`` (seconds between checkpoints, None: none scheduled)
    and ``domains`` (devices that fail together, None: each alone) feed the next
    fault's cost (:class:`Fallback`); ``idle`` are live devices ``plan`` leaves
    idle; ``measured``: step times measured in this run; ``relayout_peak``: the most memory a device needs while
    the state moves onto a plan (:func:`_relayout_check`; None: not checked). A forced policy that is infeasible
    falls back to the best feasible candidate, and the note says so; with none feasible, the note says what no
    survivor holds.
    """
    if policy.name not in list(Policy):
        raise ValueError(f"policy.name={policy.name!r}: use {', '.join(Policy)}")
    d_s, source = estimate_d(policy, fault_times=list(fault_times), elapsed_s=elapsed_s)
    fallback = Fallback(checkpoint_interval_s=checkpoint_interval_s, elapsed_s=elapsed_s, domains=_alive(domains, failed))
    cands = candidates(
        profile, plan, failed, planner=planner, d_s=d_s, slots=policy.reroute_slots,
        checkpoint_age_s=checkpoint_age_s, precomputed=precomputed, in_process=in_process, fallback=fallback,
        idle=idle, measured=measured, tp_sizes=tp_sizes, speeds=speeds, tagless=tagless,
    )

    def pick(cs: list[Candidate]) -> Candidate | None:
        feasible = [c for c in cs if c.feasible]
        pool = [c for c in feasible if c.name == policy.name] or feasible
        return min(pool, key=lambda c: (-c.score, c.transition, c.name)) if pool else None

    best, cands = _fit_relayout(cands, pick, _relayout_check(profile, plan, relayout_peak))
    note = ""
    if policy.name != "chameleon" and (best is None or best.name != policy.name):
        why = next(c.why for c in cands if c.name == policy.name)
        note = f"forced policy {policy.name} is infeasible ({why}); chose by Eq. 8 instead"
    if best is None and not note:
        geometry = geometry_of(plan)
        lost = geometry.lost(failed)
        note = (f"no feasible candidate: no survivor holds {geometry.describe(lost)}, and no checkpoint exists" if lost
                else "no feasible candidate, though survivors hold every region: "
                     + "; ".join(f"{c.name}: {c.why}" for c in cands))
    return Decision(policy.name, tuple(sorted(failed)), d_s, source, best.name if best else None, tuple(cands), note)


def _alive(domains, dead) -> tuple[tuple[int, ...], ...] | None:
    """``domains`` without the ``dead`` devices (emptied ones dropped)."""
    if domains is None:
        return None
    return tuple(g for g in (tuple(d for d in group if d not in dead) for group in domains) if g)


def relayered(plan: Plan, speeds: est.Speeds) -> Plan:
    """``plan`` with the layers of each pipeline that has a slow stage re-split by speed (the same devices): each
    stage keeps at least one layer, and each other layer goes where it lengthens the slowest stage least.

    Raises:
        PlanError: When no pipeline of several stages has a slow one (nothing to re-split).
    """
    pipelines, changed = [], False
    for p in plan.pipelines:
        factors = [est.slowdown(speeds, st.devices) for st in p.stages]
        if p.n_stages < 2 or max(factors) == 1.0 or not all(st.devices for st in p.stages):
            pipelines.append(p)
            continue
        counts = [1] * p.n_stages
        for _ in range(plan.n_layers - p.n_stages):
            k = min(range(p.n_stages), key=lambda k: ((counts[k] + 1) * factors[k], k))
            counts[k] += 1
        bounds = [sum(counts[:k]) for k in range(p.n_stages + 1)]
        stages = tuple(replace(st, layers=(bounds[k], bounds[k + 1])) for k, st in enumerate(p.stages))
        changed |= stages != p.stages
        pipelines.append(replace(p, stages=stages))
    if not changed:
        raise PlanError("no pipeline of several stages has a slow one whose layers could move")
    out = replace(plan, pipelines=tuple(pipelines))
    validate_plan(out)
    return out


def decide_slow(
    profile: Profile,
    plan: Plan,
    speeds: est.Speeds,
    *,
    policy: PolicyConfig,
    planner: Planner,
    horizon_s: float,
    scale: float = 1.0,
    idle: Collection[int] = (),
    fault_times: list[float] = (),
    elapsed_s: float = 0.0,
    checkpoint_age_s: float | None = None,
    checkpoint_interval_s: float | None = None,
    domains: tuple[tuple[int, ...], ...] | None = None,
    in_process: bool = False,
    tagless: bool = False,
    relayout_peak: RelayoutPeak | None = None,
) -> Decision:
    """How to train on with slow devices (``speeds``; empty: every device is back to speed), by Eq. 8.

    ``tolerate`` keeps the running plan; ``rebalance`` splits its micro-batches over its pipelines by speed (no
    state moves); ``relayer`` also gives a slow stage fewer layers (:func:`relayered`); ``replan`` takes the
    planner's best over every stage unit (``idle`` devices included), rebalanced; ``evict`` its best without the
    slow devices' units (they stay members, idle). Each is scored over
    the window the slowness is expected to last (``horizon_s``, at most the time to the next fault); step times
    are estimated at these speeds on the measured ``scale`` (measured ÷ estimated on the running plan, at these
    speeds: a plan's earlier measurements were taken at others). Ties go to the smaller transition.
    ``relayout_peak``: as :func:`decide`'s.
    """
    d_s, source = estimate_d(policy, fault_times=list(fault_times), elapsed_s=elapsed_s)
    horizon = min(d_s, horizon_s) if speeds else d_s
    fallback = Fallback(checkpoint_age_s, checkpoint_interval_s, elapsed_s, domains, in_process)
    common = dict(global_batch=plan.global_batch, d_s=horizon, slots=policy.reroute_slots, fallback=fallback,
                  measured=Measured(scale=scale), speeds=speeds, tagless=tagless)
    units = geometry_of(plan).units(set(plan.devices) | set(idle))

    def rebalance() -> Candidate:
        new = est.rebalanced(profile, plan, speeds)
        if new == plan:
            raise PlanError("its micro-batches are already split by speed" if len(plan.pipelines) > 1
                            else "one pipeline: nothing to move micro-batches to")
        return _finish("rebalance", profile, new, {"rebuild": est.rebuild_time(profile, new)}, **common)

    def replan(name: str, onto: list[tuple[int, ...]]) -> Candidate:
        options = replans(planner, onto, n_micro=plan.n_micro_batches, micro_batch_size=plan.micro_batch_size,
                          previous=plan, domains=domains) if onto else []
        if not options:
            raise PlanError("no plan on the devices left")
        return _best([_moved(name, profile, plan, est.rebalanced(profile, new, speeds), {"search": search_s}, **common)
                      for new, search_s in options])

    def evict() -> Candidate:
        if not speeds:
            raise PlanError("no device is slow")
        return replan("evict", [u for u in units if not set(u) & set(speeds)])

    def relayer() -> Candidate:
        return _moved("relayer", profile, plan, est.rebalanced(profile, relayered(plan, speeds), speeds), {}, **common)

    cands = (_finish("tolerate", profile, plan, {}, **common), _built("rebalance", rebalance),
             _built("relayer", relayer), _built("replan", lambda: replan("replan", units)), _built("evict", evict))
    best, cands = _fit_relayout(
        cands, lambda cs: min((c for c in cs if c.feasible), key=lambda c: (-c.score, c.transition, c.name),
                              default=cs[0]),
        _relayout_check(profile, plan, relayout_peak))
    slow = ", ".join(f"{d} ×{f:.2f}" for d, f in sorted(speeds.items())) or "none any more"
    return Decision(policy.name, tuple(sorted(speeds)), horizon,
                    f"the slowness's expected remaining {horizon_s:.0f} s, at most D ({source})" if speeds else source,
                    best.name, cands, f"slow devices: {slow}")


def decide_growth(
    profile: Profile,
    plan: Plan,
    joining: Collection[int],
    *,
    policy: PolicyConfig,
    planner: Planner,
    fault_times: list[float] = (),
    elapsed_s: float = 0.0,
    checkpoint_age_s: float | None = None,
    checkpoint_interval_s: float | None = None,
    domains: tuple[tuple[int, ...], ...] | None = None,
    in_process: bool = False,
    precomputed: Plan | None = None,
    measured: Measured = Measured(),
    relayout_peak: RelayoutPeak | None = None,
) -> Decision:
    """Whether devices that came back should join: ``stay`` on ``plan`` or ``grow`` onto a re-plan over every
    stage unit (:func:`replans`), by the same reasoning as a fault (the transition against faster steps until
    the next fault, less that fault's expected cost). Ties stay. A grown plan puts to work some device ``plan``
    leaves out (else it would be a re-plan, not a growth). A forced ``policy.name`` always grows back when it can,
    as the systems it stands for heal whenever devices return.

    Args:
        joining: the returning devices (and any other live device ``plan`` leaves idle).
        precomputed: the planner's best plan over every unit, if already searched.
        measured: step times measured in this run (the plans that ran are options too).
        relayout_peak: as :func:`decide`'s.
    """
    d_s, source = estimate_d(policy, fault_times=list(fault_times), elapsed_s=elapsed_s)
    fallback = Fallback(checkpoint_age_s, checkpoint_interval_s, elapsed_s, domains, in_process)
    common = dict(global_batch=plan.global_batch, d_s=d_s, slots=policy.reroute_slots, fallback=fallback, measured=measured)
    stay = _finish("stay", profile, plan, {}, **common)

    def grow() -> Candidate:
        options = replans(planner, geometry_of(plan).units(set(plan.devices) | set(joining)), n_micro=plan.n_micro_batches,
                          micro_batch_size=plan.micro_batch_size, previous=plan, precomputed=precomputed, domains=domains,
                          measured=measured)
        working = [(new, search_s) for new, search_s in options if set(new.devices) - set(plan.devices)]
        if not working:
            raise PlanError("no plan puts a device back to work that the running plan leaves out")
        return _best([_moved("grow", profile, plan, new, {"search": search_s}, **common) for new, search_s in working])

    def pick(cs: list[Candidate]) -> Candidate:
        feasible = [c for c in cs if c.feasible and (policy.name == "chameleon" or c.name == "grow")] or [stay]
        return max(feasible, key=lambda c: (c.score, c.name == "stay"))

    best, cands = _fit_relayout((stay, _built("grow", grow)), pick, _relayout_check(profile, plan, relayout_peak))
    joined = sorted(joining)
    return Decision(policy.name, tuple(joined), d_s, source, best.name, cands, f"devices {joined} returned")
