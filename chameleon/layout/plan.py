"""Execution plans: pipelines of stages, each stage a TP group running a layer range.

A plan is pure data. Every other part of Chameleon (layouts, schedules, the
estimator, the planner, the runtime) reads it; nothing mutates it. Pipelines may
differ in length (uneven plans), and a stage whose devices died may have its
micro-batches rerouted to the same stage of peer pipelines.

Step ``k`` always trains the global samples ``[k·B, (k+1)·B)``. They are cut into
``B / micro_batch_size`` micro-batches; pipeline ``j`` runs the contiguous block of
micro-batches given by :func:`micro_batch_ranges`, so which micro-batch a sample
lands in is a function of the plan alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property


class PlanError(ValueError):
    """A plan that cannot run; the message names the config key and the fix."""


class Recompute(StrEnum):
    """Activation recomputation of a stage (``train.recompute``, every stage's at the start), each keeping less than
    the one before: keep every activation; keep a layer's matmul and attention outputs and recompute its
    element-wise ops (norms, rotations, activations) in backward; or keep only each layer's input and recompute
    the whole layer."""

    none = "none"
    selective = "selective"
    full = "full"


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the devices of its TP group, its layers ``[start, stop)`` and their recomputation.

    A stage with no devices lost them all; a :class:`Reroute` must then say who
    runs its micro-batches.
    """

    devices: tuple[int, ...]
    layers: tuple[int, int]
    recompute: Recompute = Recompute.none

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def n_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class Pipeline:
    """A full model replica split into consecutive stages, with its micro-batch share."""

    stages: tuple[Stage, ...]
    micro_batches: int

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for s in self.stages for d in s.devices)


@dataclass(frozen=True)
class Reroute:
    """Micro-batches of a device-less stage, run by the same stage of peer pipelines.

    Micro-batch ``i`` (counted within the rerouted pipeline) is run, forward and
    backward, by the stage ``stage`` of pipeline ``hosts[i % len(hosts)]``.
    """

    pipeline: int
    stage: int
    hosts: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """The whole job's layout: pipelines, micro-batch size and any reroutes."""

    n_layers: int
    micro_batch_size: int
    pipelines: tuple[Pipeline, ...]
    reroutes: tuple[Reroute, ...] = field(default=())

    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @property
    def n_micro_batches(self) -> int:
        return sum(p.micro_batches for p in self.pipelines)

    @property
    def global_batch(self) -> int:
        return self.n_micro_batches * self.micro_batch_size

    @cached_property
    def devices(self) -> tuple[int, ...]:
        """Every device the plan uses, in pipeline-then-stage order (a plan is immutable: found once)."""
        return tuple(d for p in self.pipelines for d in p.devices)

    @cached_property
    def device_set(self) -> frozenset[int]:
        """:attr:`devices` as a set."""
        return frozenset(self.devices)

    def to_dict(self) -> dict:
        """What ``dataclasses.asdict`` makes of the plan, built directly: every decision's record holds its candidates'
        plans, and at thousands of devices ``asdict`` took a quarter of a second on the controller's loop."""
        return {
            "n_layers": self.n_layers, "micro_batch_size": self.micro_batch_size,
            "pipelines": tuple({"stages": tuple({"devices": st.devices, "layers": st.layers, "recompute": st.recompute}
                                                for st in p.stages), "micro_batches": p.micro_batches}
                               for p in self.pipelines),
            "reroutes": tuple({"pipeline": r.pipeline, "stage": r.stage, "hosts": r.hosts} for r in self.reroutes),
        }

    def describe(self) -> str:
        """One line per pipeline, e.g. ``pipe0 [0:2|2:4 rc=full] tp1 ×4mb on 0,1`` (a stage that recomputes says
        how: ``rc=selective`` or ``rc=full``)."""
        lines = []
        for j, p in enumerate(self.pipelines):
            stages = _stages_text(p)
            if not p.devices:
                lines.append(f"pipe{j} [{stages}] no devices left; its {p.micro_batches}mb run rerouted")
                continue
            tps = sorted({s.tp for s in p.stages if s.devices})
            devs = ",".join(map(str, p.devices))
            lines.append(f"pipe{j} [{stages}] tp{'/'.join(map(str, tps))} ×{p.micro_batches}mb on {devs}")
        for r in self.reroutes:
            lines.append(f"reroute pipe{r.pipeline} stage{r.stage} → pipes {','.join(map(str, r.hosts))}")
        return "\n".join(lines)

    def summary(self, previous: Plan | None = None, *, limit: int = 8) -> str:
        """:meth:`describe` when it takes at most ``limit`` lines; else one line per shape of pipeline (its
        stages, TP degrees and micro-batches) with how many pipelines have it, and what changed from
        ``previous``: for the terminal, with the whole plan in the run's records."""
        if len(self.pipelines) + len(self.reroutes) <= limit:
            return self.describe()
        shapes: dict[str, int] = {}
        for p in self.pipelines:
            stages = _stages_text(p)
            tps = "/".join(map(str, sorted({s.tp for s in p.stages if s.devices}))) or "-"
            key = f"[{stages}] tp{tps} ×{p.micro_batches}mb" + ("" if p.devices else " (rerouted)")
            shapes[key] = shapes.get(key, 0) + 1
        lines = [f"{count} × {key}" for key, count in sorted(shapes.items(), key=lambda kv: -kv[1])]
        lines.append(f"{len(self.pipelines)} pipelines on {len(self.devices)} devices, {self.n_micro_batches} "
                     f"micro-batches, {len(self.reroutes)} reroutes")
        if previous is not None:
            gone, new = set(previous.devices) - set(self.devices), set(self.devices) - set(previous.devices)
            lines.append(f"changed: {len(gone)} devices out, {len(new)} in, {len(previous.pipelines)} → "
                         f"{len(self.pipelines)} pipelines")
        return "\n".join(lines)


def _stages_text(pipeline: Pipeline) -> str:
    """A pipeline's stages as ``0:2|2:4 rc=full``: each one's layers, and its recomputation where it has one."""
    return "|".join(f"{s.layers[0]}:{s.layers[1]}" + ("" if s.recompute == Recompute.none else f" rc={s.recompute}")
                    for s in pipeline.stages)


def recomputing(plan: Plan, mode_of: Callable[[int, int], Recompute]) -> Plan:
    """``plan`` with stage ``s`` of pipeline ``j`` under recomputation ``mode_of(j, s)``."""
    pipelines = tuple(replace(p, stages=tuple(replace(st, recompute=mode_of(j, s)) for s, st in enumerate(p.stages)))
                      for j, p in enumerate(plan.pipelines))
    return replace(plan, pipelines=pipelines)


def micro_batch_ranges(plan: Plan) -> list[range]:
    """The global micro-batch indices each pipeline runs, as contiguous ranges."""
    ranges, start = [], 0
    for p in plan.pipelines:
        ranges.append(range(start, start + p.micro_batches))
        start += p.micro_batches
    return ranges


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``n_stages`` contiguous ranges as evenly as possible.

    The remainder goes to the last stages: early stages of 1F1B hold the most
    in-flight activations and also carry the embedding.
    """
    base, extra = divmod(n_layers, n_stages)
    sizes = [base + (1 if s >= n_stages - extra else 0) for s in range(n_stages)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def even_plan(*, dp: int, pp: int, tp: int, n_layers: int, global_batch: int, micro_batch: int,
              recompute: Recompute = Recompute.none) -> Plan:
    """The failure-free plan from ``parallel.dp/pp/tp``: pipeline ``j`` owns a contiguous rank block, every stage
    under ``recompute``."""
    n_micro = _micro_batch_count(global_batch, micro_batch)
    for key, value in (("dp", dp), ("pp", pp), ("tp", tp)):
        if value < 1:
            raise PlanError(f"parallel.{key}={value}: must be ≥ 1")
    if pp > n_layers:
        raise PlanError(f"parallel.pp={pp} exceeds model.n_layers={n_layers}: use at most one stage per layer")
    if n_micro % dp:
        raise PlanError(
            f"train.global_batch/train.micro_batch = {n_micro} micro-batches cannot be split evenly over "
            f"parallel.dp={dp} pipelines: make it a multiple of {dp}"
        )
    layer_ranges = split_layers(n_layers, pp)
    pipelines = []
    for j in range(dp):
        stages = tuple(
            Stage(devices=tuple(range((j * pp + s) * tp, (j * pp + s + 1) * tp)), layers=layer_ranges[s],
                  recompute=recompute)
            for s in range(pp)
        )
        pipelines.append(Pipeline(stages=stages, micro_batches=n_micro // dp))
    plan = Plan(n_layers=n_layers, micro_batch_size=micro_batch, pipelines=tuple(pipelines))
    validate_plan(plan)
    return plan


def plan_from_spec(
    spec: list[dict], *, tp: int, n_layers: int, global_batch: int, micro_batch: int,
    recompute: Recompute = Recompute.none,
) -> Plan:
    """An explicit (possibly uneven) plan from ``parallel.pipelines``.

    Each entry is ``{"layers": [[0, 3], [3, 6], [6, 8]], "micro_batches": 3}``; a
    stage given as an integer ``n`` means "the next n layers". Devices are handed
    out in order, ``tp`` per stage, or the entry's own ``"tp"`` (each pipeline its TP size).
    Every stage is under ``recompute``, or the entry's own ``"recompute"``, one per stage.
    """
    pipelines, next_device = [], 0
    for j, entry in enumerate(spec):
        stages, start, width = [], 0, int(entry.get("tp") or tp)
        for item, mode in zip(entry["layers"], _stage_recompute(j, entry, recompute), strict=True):
            if isinstance(item, int):
                lo, hi = start, start + item
            else:
                lo, hi = int(item[0]), int(item[1])
            stages.append(Stage(devices=tuple(range(next_device, next_device + width)), layers=(lo, hi),
                                recompute=mode))
            next_device += width
            start = hi
        pipelines.append(Pipeline(stages=tuple(stages), micro_batches=int(entry["micro_batches"])))
    plan = Plan(n_layers=n_layers, micro_batch_size=micro_batch, pipelines=tuple(pipelines))
    n_micro = _micro_batch_count(global_batch, micro_batch)
    if plan.n_micro_batches != n_micro:
        raise PlanError(
            f"parallel.pipelines micro_batches sum to {plan.n_micro_batches}, but "
            f"train.global_batch/train.micro_batch = {n_micro}: make the shares add up to {n_micro}"
        )
    validate_plan(plan)
    return plan


def _stage_recompute(j: int, entry: dict, default: Recompute) -> list[Recompute]:
    """The recomputation of each stage of ``parallel.pipelines[j]``: its ``"recompute"`` list, else ``default``."""
    modes = entry.get("recompute") or [default] * len(entry["layers"])
    if len(modes) != len(entry["layers"]) or not set(modes) <= set(Recompute):
        raise PlanError(f"parallel.pipelines[{j}].recompute={list(modes)}: give one of {', '.join(Recompute)} "
                        f"for each of its {len(entry['layers'])} stages")
    return [Recompute(mode) for mode in modes]


def validate_plan(plan: Plan) -> None:
    """Raise :class:`PlanError` unless every pipeline covers every layer once and devices are unique."""
    if not plan.pipelines:
        raise PlanError("parallel.pipelines is empty: give at least one pipeline")
    seen: set[int] = set()
    for j, p in enumerate(plan.pipelines):
        if p.micro_batches < 1:
            raise PlanError(f"parallel.pipelines[{j}].micro_batches={p.micro_batches}: every pipeline needs ≥ 1")
        expect = 0
        for s, stage in enumerate(p.stages):
            lo, hi = stage.layers
            if lo != expect or hi <= lo:
                raise PlanError(
                    f"parallel.pipelines[{j}] stage {s} has layers [{lo}, {hi}) but should start at {expect} "
                    "and be non-empty: stages must tile [0, model.n_layers) in order"
                )
            expect = hi
            for d in stage.devices:
                if d in seen:
                    raise PlanError(f"device {d} appears twice in the plan: each device runs one stage")
                seen.add(d)
        if expect != plan.n_layers:
            raise PlanError(
                f"parallel.pipelines[{j}] covers layers [0, {expect}) but model.n_layers={plan.n_layers}: "
                "the last stage must end at n_layers"
            )
    rerouted = {(r.pipeline, r.stage) for r in plan.reroutes}
    for j, p in enumerate(plan.pipelines):
        for s, stage in enumerate(p.stages):
            if not stage.devices and (j, s) not in rerouted:
                raise PlanError(f"pipeline {j} stage {s} has no devices and no reroute")
    for r in plan.reroutes:
        lost = plan.pipelines[r.pipeline].stages[r.stage]
        for h in r.hosts:
            host = plan.pipelines[h].stages
            if r.stage >= len(host) or host[r.stage].layers != lost.layers or not host[r.stage].devices:
                raise PlanError(f"reroute host pipeline {h} has no live stage {r.stage} with layers {lost.layers}")


def _micro_batch_count(global_batch: int, micro_batch: int) -> int:
    if micro_batch < 1 or global_batch % micro_batch:
        raise PlanError(
            f"train.global_batch={global_batch} is not divisible by train.micro_batch={micro_batch}: "
            "pick a micro-batch that divides the global batch"
        )
    return global_batch // micro_batch
