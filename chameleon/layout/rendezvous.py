"""Whether a step's point-to-point traffic is safe on NCCL's rules, checked before a pipelined plan runs there.

NCCL and HCCL ignore tags: the k-th message one device sends another is the k-th
that device receives from it, so a step is safe only if, over every pair and
direction, the tags sent and the tags received come in the same order (else a
receive silently takes another micro-batch's tensor). And a send of any real
size waits for its receive: on each pair's communicator, a group call (the
sends and receives posted as one batch) runs in the order posted, and its ops
complete only when the peer's matching group runs too. :func:`rendezvous_fault`
replays every device's posts and waits (:func:`~chameleon.layout.schedule.exchanges`,
exactly as the runtime executes them) under that strictest reading — no message
is buffered — and names the first mismatch or deadlock; gloo, which honours tags
and buffers, needs none of this.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from chameleon.layout.plan import Plan
from chameleon.layout.schedule import Action, Exchange, exchanges, step_actions


@dataclass
class _Group:
    """One group call of one device on the communicator it shares with ``peer``: the tags it sends and receives,
    and once posted, the position of each of its messages in its direction's order."""

    device: int
    peer: int
    sends: list[int] = field(default_factory=list)
    receives: list[int] = field(default_factory=list)
    messages: list[tuple[int, int, int]] = field(default_factory=list)  # (from, to, position)


def _program(plan: Plan, actions: list[Action], me: int) -> list[tuple[str, _Group]]:
    """``me``'s posts and waits, in order: each action's receive (with the send held for it) posted and waited for,
    then its send posted unless held."""
    program: list[tuple[str, _Group]] = []
    held = None
    for exchange in exchanges(plan, actions, me):
        if exchange.receive is not None:
            group = _Group(me, exchange.receive.peer, sends=[held.tag] if held else [], receives=[exchange.receive.tag])
            program += [("post", group), ("wait", group)]
            held = None
        if exchange.send is not None:
            held = _post_send(program, me, exchange)
    return program


def _post_send(program: list[tuple[str, _Group]], me: int, exchange: Exchange):
    """Post ``exchange``'s send alone, or return it to go with the next receive."""
    if exchange.held:
        return exchange.send
    program.append(("post", _Group(me, exchange.send.peer, sends=[exchange.send.tag])))
    return None


def rendezvous_fault(plan: Plan) -> str | None:
    """Why one step of ``plan`` would mismatch messages or deadlock on a backend that ignores tags and buffers no
    send (NCCL's rules, read strictly); None when it is safe there."""
    programs = {device: _program(plan, actions, device) for device, actions in step_actions(plan).items()}
    sent: dict[tuple[int, int], list[int]] = defaultdict(list)  # (from, to) → tags in posting order
    received: dict[tuple[int, int], list[int]] = defaultdict(list)
    for device, program in programs.items():
        for op, group in program:
            if op == "post":
                sent[(device, group.peer)] += group.sends
                received[(group.peer, device)] += group.receives
    for link in sorted(sent.keys() | received.keys()):
        if sent[link] != received[link]:
            return (f"device {link[0]} sends device {link[1]} tags {sent[link][:6]} but it receives "
                    f"{received[link][:6]} (in order, the first six): without tags they would be matched wrongly")
    return _deadlock(programs)


def _deadlock(programs: dict[int, list[tuple[str, _Group]]]) -> str | None:
    """Replay ``programs`` under strict rendezvous: the devices stuck, or None when every one finishes. A message
    passes once the sender's and the receiver's groups holding it both run (head of their pair's queue); a group
    finishes once all its messages passed."""
    pc = dict.fromkeys(programs, 0)
    queues: dict[tuple[int, int], list[_Group]] = defaultdict(list)  # (device, peer) → its group calls, in order
    head: dict[tuple[int, int], int] = defaultdict(int)
    count: dict[tuple[int, int, int], int] = defaultdict(int)  # (poster, from, to) → its messages posted so far
    passed: set[tuple[int, int, int]] = set()
    finished: set[int] = set()  # ids of finished groups

    def running(device: int, peer: int) -> set[tuple[int, int, int]]:
        calls = queues.get((device, peer), ())
        return set(calls[head[(device, peer)]].messages) if head[(device, peer)] < len(calls) else set()

    progressed = True
    while progressed:
        progressed = False
        for device, program in programs.items():
            while pc[device] < len(program):
                op, group = program[pc[device]]
                if op == "wait" and id(group) not in finished:
                    break
                if op == "post":
                    for direction, tags in (((device, group.peer), group.sends), ((group.peer, device), group.receives)):
                        group.messages += [(*direction, count[(device, *direction)] + k) for k in range(len(tags))]
                        count[(device, *direction)] += len(tags)
                    queues[(device, group.peer)].append(group)
                pc[device] += 1
                progressed = True
        for (device, peer), calls in queues.items():
            while head[(device, peer)] < len(calls):
                group = calls[head[(device, peer)]]
                passed.update(set(group.messages) & running(peer, device))
                if not passed.issuperset(group.messages):
                    break
                finished.add(id(group))
                head[(device, peer)] += 1
                progressed = True
    stuck = sorted({d for d, program in programs.items() if pc[d] < len(program)}
                   | {d for (d, peer), calls in queues.items() if head[(d, peer)] < len(calls)})
    return None if not stuck else f"devices {stuck[:8]} would wait on each other for ever (sends no receive meets)"
