"""The commit ledger, as a pure state machine: every transition of docs/protocol.md's state table.

Nodes report for their devices (one node per device here unless a test says otherwise: the
ledger's checks are per node, and a node of several devices reports them together).
"""

from __future__ import annotations

import pytest

from chameleon.runtime.control.ledger import CheckpointComplete, CommitStep, Evaluation, Ledger, StartGeneration
from chameleon.runtime.protocol.errors import TrainingError
from chameleon.runtime.protocol.messages import NodeEvaluated, NodeReady, NodeSaved, NodeSynced, sample_ranges
from chameleon.runtime.protocol.topology import Topology

B = 4  # global batch


def ledger(per_node: int = 1, **kw) -> Ledger:
    led = Ledger(global_batch=B, steps=kw.pop("steps", 3), topology=Topology(nnodes=3, per_node=per_node),
                 first_step=kw.pop("first_step", 0))
    led.publish(0, members=(0, 1, 2), trainers=(0, 1), writers=(0,), resume_step=led.resume_step, **kw)
    return led


def ready(node: int, generation: int = 0, devices=None) -> NodeReady:
    return NodeReady(node, generation, tuple(devices if devices is not None else (node,)))


def synced(node: int, step: int, ids, generation: int = 0, loss: float = 1.0, devices=None, norm_sq=None,
           t: float = 0.0) -> NodeSynced:
    return NodeSynced(node, generation, step, tuple(devices if devices is not None else (node,)), loss,
                      sample_ranges(ids), 0.1, norm_sq, t)


def started(led: Ledger) -> Ledger:
    for d in sorted(led.members):
        led.on_ready(ready(led.topology.node_of(d), led.generation, (d,)))
    return led


def test_a_generation_starts_once_every_member_is_ready():
    led = ledger()
    assert led.on_ready(ready(0)) is None and led.on_ready(ready(1)) is None
    assert led.unreported() == {2}
    assert led.on_ready(ready(2)) == StartGeneration(0, 0)
    assert led.on_ready(ready(2)) is None  # started: nothing more to start


def test_a_step_commits_when_every_node_reported_exactly_its_samples():
    led = started(ledger())
    assert led.on_synced(synced(0, 0, [0, 1], loss=0.25, norm_sq=4.0, t=1.0)) is None
    assert led.unreported() == {1}
    assert led.on_synced(synced(1, 0, [3, 2], loss=0.5, norm_sq=5.0, t=2.0)) == CommitStep(0, 0.75, (0, 4), 0.1, 3.0, 2.0)
    assert led.committed == 0 and led.next_step == 1 and not led.finished


def test_a_node_reports_all_of_its_trainers_at_once():
    led = started(ledger(per_node=2))  # devices 0, 1 on node 0 (both trainers); 2 on node 1 (a member only)
    assert led.unreported() == {0, 1}
    assert led.on_synced(synced(0, 0, range(4), devices=(0, 1))).samples == (0, 4)
    with pytest.raises(TrainingError, match="but its trainers are"):
        led.on_synced(synced(0, 1, range(4, 8), devices=(0,)))


def test_the_last_commit_finishes_the_job():
    led = started(ledger(steps=1))
    led.on_synced(synced(0, 0, [0, 1]))
    led.on_synced(synced(1, 0, [2, 3]))
    assert led.finished


@pytest.mark.parametrize("ids", [[2, 3, 3], [2], [2, 3, 4], [1, 2, 3]], ids=["duplicated", "lost", "foreign", "overlap"])
def test_lost_or_duplicated_samples_stop_the_run(ids):
    led = started(ledger())
    led.on_synced(synced(0, 0, [0, 1]))
    with pytest.raises(TrainingError, match="lost or duplicated"):
        led.on_synced(synced(1, 0, ids))


def test_a_step_out_of_order_or_reported_twice_is_an_error():
    led = started(ledger())
    with pytest.raises(TrainingError, match="while step 0 is open"):
        led.on_synced(synced(0, 1, [4, 5]))
    led.on_synced(synced(0, 0, [0, 1]))
    with pytest.raises(TrainingError, match="twice"):
        led.on_synced(synced(0, 0, [0, 1]))


def test_messages_of_another_generation_or_from_strangers_are_dropped():
    led = ledger()
    assert led.on_ready(ready(0, generation=7)) is None and led.ready == set()
    assert led.on_ready(ready(9)) is None and led.ready == set()
    started(led)
    with pytest.raises(TrainingError, match="but its trainers are"):  # a member without a stage does not train
        led.on_synced(synced(2, 0, [0, 1, 2, 3]))
    assert led.on_synced(synced(0, 0, [0, 1], generation=3)) is None


def test_nothing_of_a_broken_generation_commits_and_the_next_one_resumes_where_told():
    led = started(ledger())
    led.on_synced(synced(0, 0, [0, 1]))
    led.break_generation()
    assert led.on_synced(synced(1, 0, [2, 3])) is None and led.committed == -1
    led.publish(1, members=(0, 2), trainers=(0, 2), writers=(0,), resume_step=0)
    assert not led.started and led.unreported() == {0, 2}
    started(led)
    led.on_synced(synced(0, 0, [0, 1], generation=1))
    assert led.on_synced(synced(2, 0, [2, 3], generation=1)).step == 0


def test_a_checkpoint_reload_goes_back():
    led = started(ledger(steps=10))
    for step in range(4):
        led.on_synced(synced(0, step, range(step * B, step * B + 2)))
        led.on_synced(synced(1, step, range(step * B + 2, (step + 1) * B)))
    led.break_generation()
    led.publish(1, members=(0,), trainers=(0,), writers=(0,), resume_step=2)
    assert led.committed == 1 and led.next_step == 2


def test_generations_only_move_forward():
    led = ledger()
    with pytest.raises(ValueError, match="not newer"):
        led.publish(0, members=(0,), trainers=(0,), writers=(0,), resume_step=0)
    with pytest.raises(ValueError, match="trainers must be members"):
        led.publish(1, members=(0,), trainers=(0, 1), writers=(0,), resume_step=0)


def test_a_checkpoint_completes_once_every_writer_saved_it():
    led = started(ledger())
    led.publish(1, members=(0, 1), trainers=(0, 1), writers=(0, 1), resume_step=0)
    assert led.on_saved(NodeSaved(0, 1, 5, (0,))) is None
    assert led.on_saved(NodeSaved(7, 1, 5, (7,))) is None  # not a writer
    assert led.on_saved(NodeSaved(1, 1, 5, (1,))) == CheckpointComplete(5, 1, (0, 1))


def test_an_intact_earlier_generation_still_completes_its_checkpoint_but_a_broken_one_never():
    led = started(ledger())
    led.publish(1, members=(0, 1, 2), trainers=(0, 1, 2), writers=(0, 1), resume_step=1)  # grown: gen 0 intact
    assert led.on_saved(NodeSaved(0, 0, 1, (0,))) == CheckpointComplete(1, 0, (0,))
    led.on_saved(NodeSaved(0, 1, 2, (0,)))
    led.break_generation()
    assert led.on_saved(NodeSaved(1, 1, 2, (1,))) is None


def test_a_validation_loss_is_whole_once_every_node_with_trainers_reported_it():
    led = started(ledger())
    assert led.on_evaluated(NodeEvaluated(0, 0, 3, (0,), 1.25)) is None
    assert led.on_evaluated(NodeEvaluated(1, 0, 3, (1,), 0.5)) == Evaluation(3, 1.75)
    with pytest.raises(TrainingError, match="but its trainers are"):
        led.on_evaluated(NodeEvaluated(0, 0, 3, (0, 2), 1.0))
    led.on_evaluated(NodeEvaluated(0, 0, 6, (0,), 1.0))
    led.break_generation()  # a lost member: its generation's half-booked validation never completes
    assert led.on_evaluated(NodeEvaluated(1, 0, 6, (1,), 1.0)) is None


def test_a_step_whose_replicas_disagree_does_not_commit_and_names_the_outvoted():
    """Devices 0, 1, 2 hold the same regions (one node each): the one digest unlike the others' is outvoted."""
    def run(digests: dict[int, int]) -> CommitStep:
        led = Ledger(global_batch=B, steps=3, topology=Topology(nnodes=3, per_node=1))
        led.publish(0, members=(0, 1, 2), trainers=(0, 1, 2), writers=(0,), resume_step=0, replica_groups=((0, 1, 2),))
        started(led)
        for node, ids in ((0, [0]), (1, [1]), (2, [2, 3])):
            message = synced(node, 0, ids)
            out = led.on_synced(NodeSynced(*[getattr(message, f) for f in ("node", "generation", "step", "devices",
                                                                         "loss_sum", "samples", "compute_s", "norm_sq",
                                                                         "t_synced")], (), ((node, digests[node]),)))
        assert led.committed == (0 if out.commits else -1)
        return out

    assert run({0: 7, 1: 7, 2: 7}).outvoted == ()
    assert run({0: 7, 1: 9, 2: 7}).outvoted == (1,)
    assert run({0: 7, 1: 8, 2: 9}).outvoted == (0, 1, 2), "no majority: every holder is named"
