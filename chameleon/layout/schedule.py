"""1F1B schedules as explicit action lists: what every device runs in one step, in order.

:func:`one_f_one_b` gives one stage's order (warm-up forwards, alternating
forward/backward, cool-down backwards). :func:`step_actions` gives every device's
list for a whole plan — pipelines of different lengths and micro-batch counts, and
rerouted stages whose micro-batches run on same-stage peers of other pipelines.

A device may then serve several pipelines (its own and, as a reroute host, a
peer's). Its list merges one queue per pipeline, each in that pipeline's 1F1B
order, by simulating the step: every device's merged order is then a sub-order
of one global topological order of the step's dependency graph, so with
non-blocking sends no device can wait on another in a cycle.

:func:`exchanges` gives the point-to-point traffic of a device's list: what each
action receives before it computes and sends after, tagged per (pipeline,
sending stage, direction). The runtime executes these lists and exchanges
(:mod:`chameleon.runtime.worker.schedule`), the estimator times the lists, and
:mod:`chameleon.layout.rendezvous` checks the exchanges against NCCL's rules, so
all three follow one order.
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon.layout.plan import Plan

FORWARD_COST, BACKWARD_COST = 1, 2  # relative durations used to merge queues
MAX_STAGES = 1 << 12


@dataclass(frozen=True)
class Action:
    """Forward (``"F"``) or backward (``"B"``) of micro-batch ``micro`` (within its pipeline) on a stage."""

    kind: str
    pipeline: int
    stage: int
    micro: int


def one_f_one_b(*, pipeline: int, stage: int, n_stages: int, n_micro: int) -> list[Action]:
    """1F1B order for one stage: ``n_stages − stage − 1`` warm-up forwards, then F/B pairs, then cool-down."""
    warmup = min(n_stages - stage - 1, n_micro)
    actions = [Action("F", pipeline, stage, i) for i in range(warmup)]
    for i in range(n_micro - warmup):
        actions.append(Action("F", pipeline, stage, warmup + i))
        actions.append(Action("B", pipeline, stage, i))
    actions.extend(Action("B", pipeline, stage, i) for i in range(n_micro - warmup, n_micro))
    return actions


@dataclass(frozen=True)
class Link:
    """One message of a step: the device at the other end, and the message's tag."""

    peer: int
    tag: int


@dataclass(frozen=True)
class Exchange:
    """One action's point-to-point traffic on one device: what it receives before it computes (activations for a
    forward, the gradient for a backward) and what it sends after. A ``held`` send goes to the very device the
    next action receives from, and is posted with that receive as one batch: 1F1B's steady state, activations out
    and gradients back over one pair at once, which NCCL needs in one group call."""

    receive: Link | None
    send: Link | None
    held: bool = False


def message_tag(pipeline: int, sender_stage: int, backward: bool) -> int:
    """The tag of activations (forward) or gradients (backward) a stage of a pipeline sends."""
    return (pipeline * MAX_STAGES + sender_stage) * 2 + int(backward)


def exchanges(plan: Plan, actions: list[Action], me: int) -> list[Exchange]:
    """The traffic of each of device ``me``'s ``actions``, in order; a stage's TP rank talks to the same rank of the
    stage before and after it."""
    traffic = []
    for action in actions:
        p, s, i = action.pipeline, action.stage, action.micro
        rank = executors(plan, p, s, i).index(me)
        first, last = s == 0, s == plan.pipelines[p].n_stages - 1
        above = None if first else executors(plan, p, s - 1, i)[rank]
        below = None if last else executors(plan, p, s + 1, i)[rank]
        if action.kind == "F":
            receive = None if first else Link(above, message_tag(p, s - 1, False))
            send = None if last else Link(below, message_tag(p, s, False))
        else:
            receive = None if last else Link(below, message_tag(p, s + 1, True))
            send = None if first else Link(above, message_tag(p, s, True))
        traffic.append((receive, send))
    receives_next = [r for r, _ in traffic[1:]] + [None]
    return [Exchange(receive, send, held=send is not None and after is not None and after.peer == send.peer)
            for (receive, send), after in zip(traffic, receives_next)]


def executors(plan: Plan, pipeline: int, stage: int, micro: int) -> tuple[int, ...]:
    """The devices (TP mesh) that run micro-batch ``micro`` of ``pipeline`` at ``stage``."""
    devices = plan.pipelines[pipeline].stages[stage].devices
    if devices:
        return devices
    reroute = next(r for r in plan.reroutes if (r.pipeline, r.stage) == (pipeline, stage))
    return plan.pipelines[reroute.hosts[micro % len(reroute.hosts)]].stages[stage].devices


def dependency(plan: Plan, action: Action) -> Action | None:
    """The action whose output ``action`` needs: F on the stage above, B below (the last stage's own F); None for a first F."""
    n_stages = plan.pipelines[action.pipeline].n_stages
    if action.kind == "F":
        return Action("F", action.pipeline, action.stage - 1, action.micro) if action.stage > 0 else None
    if action.stage == n_stages - 1:
        return Action("F", action.pipeline, action.stage, action.micro)
    return Action("B", action.pipeline, action.stage + 1, action.micro)


def step_actions(plan: Plan) -> dict[int, list[Action]]:
    """Every device's action list for one step of ``plan`` (TP ranks of a stage share a list)."""
    queues: dict[tuple[int, ...], dict[int, list[Action]]] = {}
    for j, pipe in enumerate(plan.pipelines):
        for s in range(pipe.n_stages):
            for action in one_f_one_b(pipeline=j, stage=s, n_stages=pipe.n_stages, n_micro=pipe.micro_batches):
                mesh = executors(plan, j, s, action.micro)
                queues.setdefault(mesh, {}).setdefault(j, []).append(action)
    finished: dict[Action, float] = {}
    clock = dict.fromkeys(queues, 0.0)
    order: dict[tuple[int, ...], list[Action]] = {mesh: [] for mesh in queues}
    remaining = sum(len(q) for per in queues.values() for q in per.values())
    while remaining:
        progressed = False
        for mesh, per_pipeline in queues.items():
            ready = []
            for j, queue in sorted(per_pipeline.items(), key=lambda kv: (mesh not in _own(plan, kv[0]), kv[0])):
                if queue:
                    dep = dependency(plan, queue[0])
                    if dep is None or dep in finished:
                        ready.append((max(clock[mesh], finished.get(dep, 0.0)), len(ready), j))
            if not ready:
                continue
            start, _, j = min(ready)
            action = per_pipeline[j].pop(0)
            clock[mesh] = finished[action] = start + (FORWARD_COST if action.kind == "F" else BACKWARD_COST)
            order[mesh].append(action)
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("the step's schedule has a dependency cycle; the plan is invalid")
    return {device: actions for mesh, actions in order.items() for device in mesh}


def _own(plan: Plan, pipeline: int) -> set[tuple[int, ...]]:
    return {stage.devices for stage in plan.pipelines[pipeline].stages}
