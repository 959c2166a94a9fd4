"""Oobleck (SOSP'23): pipeline templates, local re-instantiation, no rerouting.

Everything below follows SymbioticLab/Oobleck: ``oobleck/planning/instantiator.py``
(instantiation and batch distribution), ``oobleck/csrc/planning/execution_result.h``
(a template's time), ``oobleck/execution/engine.py`` (``ReconfigurationEngine``)
and ``tools/simulator/oobleck_simulator.py`` (the artifact's simulator). Modelled:

- Templates: one pipeline per node count ``n`` from ``n0`` (the fewest stages that
  fit in memory) up, its layer split the one among the planner's Pareto front of
  ``n``-stage splits with the least Oobleck time ``T = T1 + T2 + T3``:
  ``T1 = Σ c_s``, ``T2 = (2S + k* + 1)·c_k*``, ``T3 = Σ_{s ≥ k*} c_s``, ``c_s`` a
  stage's forward + backward and ``k*`` its slowest stage (the later on ties).
- Instantiation: every multiset of templates using all devices with at least
  ``f + 1`` pipelines (``sim.oobleck.fault_threshold``); per template ``i`` with
  ``x_i`` instances, micro-batches ``nb_i`` (integers, ``Σ x_i·nb_i = B``) that
  minimise the variance of ``T_i/S_i · nb_i``; the option with the least
  ``max_i T_i·nb_i`` + the first layer's all-reduce wins. The estimator then
  times the chosen plan like every other.
- A fault: each pipeline keeps its surviving devices and takes the template of
  its new size; one below ``n0`` borrows devices from the biggest pipeline
  still above ``n0``, else pipelines merge; batches are redistributed as above.
  No reroute, no global re-plan.
- Pause: the in-flight step is lost; the world group, one group per pipeline and
  one data-parallel group per layer unit are created anew (``DataParallelEngine``
  calls ``new_group`` for each), each at ``cluster.group_create_ms``; missing
  layers are broadcast from the first surviving holder (``_copy_model_states``:
  weights only), timed by the busiest sender or receiver at the DP bandwidth.
  For comparison, the artifact's simulator charges a flat 10 s for GPT-3 6.7B.
- Re-joined devices idle (the artifact's ``simulate_should_reconfigure`` returns
  False for Oobleck).

A node is one stage's TP group (one card at ``parallel.tp=1``). Left out: nodes of
several stages, FSDP inside a stage, and
the pipeline and FSDP groups a re-instantiation also creates (fewer groups: a
shorter pause than Oobleck's).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from chameleon.decision import estimator as est
from chameleon.decision.planner import Split
from chameleon.decision.profiler import Profile
from chameleon.layout.geometry import geometry_of
from chameleon.layout.plan import Pipeline, Plan, Stage
from chameleon.sim.policies import Fault, Policy, Response


@dataclass(frozen=True)
class Template:
    """A pipeline template: its stage layer counts and Oobleck's time ``T``."""

    n_stages: int
    layers: tuple[int, ...]
    time: float

    def bounds(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.layers:
            out.append((start, start + n))
            start += n
        return out


def oobleck_time(costs: list[float]) -> float:
    """``T1 + T2 + T3`` of ``execution_result.h`` for per-stage forward+backward ``costs``."""
    k = max(range(len(costs)), key=lambda s: (costs[s], s))
    return sum(costs) + (2 * len(costs) + k + 1) * costs[k] + sum(costs[k:])


def make_template(profile: Profile, split: Split) -> Template:
    last = len(split.layers) - 1
    costs = [sum(est.stage_cost(profile, n, first=s == 0, last=s == last)) for s, n in enumerate(split.layers)]
    return Template(len(split.layers), split.layers, oobleck_time(costs))


def distribute_batch(n_micro: int, counts: dict[Template, int]) -> dict[Template, tuple[int, ...]] | None:
    """Micro-batches per instance of each template, summing to ``n_micro``, closest to equal ``T/S·nb`` (Oobleck §4.2.2).

    Oobleck gives every instance of a template the same ``nb`` (``Σ x·nb = n_micro``
    exactly); a dynamic program over the micro-batches used finds the best such
    split, each ``nb`` within ``width`` of its continuous optimum (widened to the
    largest count when the narrow window cannot hit ``n_micro``). When none exists
    (7 equal pipelines, 256 micro-batches) Oobleck's solver fails; here the
    instances of a template may then differ by one micro-batch instead.
    None if even that is impossible.
    """
    for width, uneven in ((1, False), (max(counts.values()) + 1, False), (1, True)):
        nbs = _distribute(n_micro, counts, width, uneven)
        if nbs is not None:
            return nbs
    return None


def _distribute(n_micro: int, counts: dict[Template, int], width: int, uneven: bool) -> dict[Template, tuple[int, ...]] | None:
    templates = sorted(counts, key=lambda t: t.n_stages)
    weight = {t: t.time / t.n_stages for t in templates}
    level = n_micro / sum(counts[t] / weight[t] for t in templates)  # the continuous optimum: T/S·nb = level for all
    best: dict[int, tuple[float, tuple]] = {0: (0.0, ())}  # micro-batches used -> (cost, per-template nbs so far)
    for t in templates:
        x, ideal = counts[t], level / weight[t]
        step: dict[int, tuple[float, tuple]] = {}
        for nb in range(max(1, math.floor(ideal) - width), math.ceil(ideal) + width + 1):
            for more in range(x if uneven else 1):  # ``more`` instances get nb + 1
                nbs = (nb + 1,) * more + (nb,) * (x - more)
                cost = sum((weight[t] * b - level) ** 2 for b in nbs)
                for used, (acc, chosen) in best.items():
                    total = used + sum(nbs)
                    value = (acc + cost, chosen + (nbs,))
                    if total <= n_micro and (total not in step or value < step[total]):
                        step[total] = value
        best = step
    if n_micro not in best:
        return None
    return dict(zip(templates, best[n_micro][1]))


def iteration_time(profile: Profile, nbs: dict[Template, tuple[int, ...]], n_pipelines: int) -> float:
    """Oobleck's plan time: ``max T_i·nb_i`` + the first layer's all-reduce across the pipelines."""
    return max(t.time * max(nb) for t, nb in nbs.items()) + est.allreduce_time(profile, n_pipelines, profile.first_params)


def build(n_layers: int, micro_batch_size: int, groups: list[tuple], templates: dict[int, Template],
          nbs: dict[Template, tuple[int, ...]], *, recompute: str) -> Plan:
    """Pipelines of the templates of their sizes; stage ``i`` of a pipeline runs on its ``i``-th node (rank order),
    every stage under ``recompute`` (the job's).

    A node is a device id, or a TP group (a tuple of ids) when stages are tensor-parallel.
    """
    pipes, taken = [], {t: iter(nb) for t, nb in nbs.items()}
    for nodes in groups:
        t = templates[len(nodes)]
        stages = tuple(Stage(devices=n if isinstance(n, tuple) else (n,), layers=b, recompute=recompute)
                       for n, b in zip(sorted(nodes), t.bounds()))
        pipes.append(Pipeline(stages=stages, micro_batches=next(taken[t])))
    return Plan(n_layers=n_layers, micro_batch_size=micro_batch_size, pipelines=tuple(pipes))


def copy_time(profile: Profile, old: Plan, new: Plan) -> float:
    """``_copy_model_states``: each missing unit's weights broadcast by its first surviving holder in ``old``.

    Whole units, as Oobleck copies them: a device lacking any of a unit's shard gets
    its shard's weights (a layer's ``1/tp``, the embedding or head whole).
    """
    before, after, n = geometry_of(old), geometry_of(new), new.n_layers
    first_holder: dict[int, int | None] = {}
    for bucket in before.buckets:
        sender = next((d for k in bucket.stages for d in before.stages[k].devices if d in after.seat), None)
        first_holder.update(dict.fromkeys(bucket.units, sender))
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    for d in after.seat:
        need, have = after.holding(d), before.holding(d)
        for unit in range(need.lo, need.hi):
            if have is None or not have.lo <= unit < have.hi:
                nbytes = profile.units.of(unit, n) / (profile.tp if 0 <= unit < n else 1) * profile.state.weight
                sender = first_holder[unit]
                sent[sender] = sent.get(sender, 0.0) + nbytes
                received[d] = received.get(d, 0.0) + nbytes
    busiest = max([*sent.values(), *received.values()], default=0.0)
    return busiest / profile.dp_bw


class OobleckPolicy(Policy):
    """Templates instantiated for all devices; a fault shrinks, borrows or merges pipelines locally."""

    def __init__(self, name: str, setup):
        super().__init__(name, setup)
        profile = self.planning.profile
        fronts = self.planning.planner.fronts
        self.templates = {n: min((make_template(profile, sp) for sp in front), key=lambda t: (t.time, t.layers))
                          for n, front in fronts.items()}
        self.n0 = min(self.templates)
        self.groups: list[tuple[tuple[int, ...], ...]] = []  # each pipeline's nodes (TP groups)

    def _plan(self, groups: list[tuple], like: Plan) -> Plan | None:
        counts: dict[Template, int] = {}
        for g in groups:
            if len(g) not in self.templates:
                return None
            t = self.templates[len(g)]
            counts[t] = counts.get(t, 0) + 1
        nbs = distribute_batch(like.n_micro_batches, counts)
        if nbs is None:
            return None
        return build(like.n_layers, like.micro_batch_size, groups, self.templates, nbs,
                     recompute=self.planning.profile.recompute)

    def start(self) -> Plan:
        plan = self.setup.plan
        nodes = sorted(self.setup.units)
        need = self.setup.sim.oobleck.fault_threshold + 1
        best = None
        for sizes in _partitions(len(nodes), sorted(self.templates)):
            if len(sizes) < need:
                continue
            counts: dict[Template, int] = {}
            for n in sizes:
                counts[self.templates[n]] = counts.get(self.templates[n], 0) + 1
            nbs = distribute_batch(plan.n_micro_batches, counts)
            if nbs is None:
                continue
            value = iteration_time(self.planning.profile, nbs, len(sizes))
            if best is None or value < best[0]:
                best = (value, sizes)
        if best is None:
            raise ValueError(f"sim.policies: oobleck finds no ≥ {need} pipelines of templates using all {len(nodes)} nodes")
        it = iter(nodes)
        self.groups = [tuple(itertools.islice(it, n)) for n in best[1]]
        return self._plan(self.groups, plan)

    def on_fault(self, plan: Plan, fault: Fault) -> Response:
        groups = [tuple(n for n in g if not fault.failed & set(n)) for g in self.groups]
        groups = reinstantiate([g for g in groups if g], self.n0)
        new = self._plan(groups, plan) if groups and not geometry_of(plan).lost(fault.failed) else None
        if new is None:
            return Response(None, 0.0, float("inf"), "halt")
        self.groups = groups
        profile = self.planning.profile
        n_groups = 1 + new.dp + new.n_layers + 2
        pause = n_groups * profile.group_create_s + copy_time(profile, plan, new)
        return Response(new, pause, self.planning.t_step(new), "reinstantiate")


def reinstantiate(groups: list[tuple], n0: int) -> list[tuple]:
    """``ReconfigurationEngine.on_reconfigure``: borrow devices for pipelines below ``n0``, else merge; smallest first."""
    groups = [list(g) for g in groups]
    short = False
    for g in groups:
        while len(g) < n0:
            donor = max(groups, key=len)
            if len(donor) <= n0:
                short = True
                break
            while len(donor) > n0 and len(g) < n0:
                g.append(donor.pop())
    if short:
        groups = _merge(groups, n0)
    return sorted((tuple(sorted(g)) for g in groups), key=lambda g: (len(g), g[0]))


def _merge(groups: list[list], n0: int) -> list[list]:
    """``_merge_pipelines``: glue pipelines below ``n0`` together (then onto a full one) until all reach ``n0``."""
    small = [g for g in groups if len(g) < n0]
    full = [g for g in groups if len(g) >= n0]
    while small:
        g = small.pop(0)
        while len(g) < n0 and (small or full):
            g = g + (small.pop(0) if small else full.pop(0))
        full.append(g)
    return full


def _partitions(total: int, sizes: list[int], start: int = 0):
    """Multisets of ``sizes`` (non-decreasing) summing to ``total``."""
    if total == 0:
        yield ()
        return
    for i in range(start, len(sizes)):
        if sizes[i] > total:
            break
        for rest in _partitions(total - sizes[i], sizes, i):
            yield (sizes[i],) + rest
