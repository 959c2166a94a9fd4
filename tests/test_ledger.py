"""The commit ledger, as a pure state machine: every transition of docs/protocol.md's state table."""

from __future__ import annotations

import pytest

from chameleon.runtime.errors import TrainingError
from chameleon.runtime.ledger import CheckpointComplete, CommitStep, Ledger, StartGeneration
from chameleon.runtime.messages import CheckpointSaved, Ready, Synced

B = 4  # global batch


def ledger(**kw) -> Ledger:
    led = Ledger(global_batch=B, steps=kw.pop("steps", 3), first_step=kw.pop("first_step", 0))
    led.publish(0, members=(0, 1, 2), trainers=(0, 1), writers=(0,), resume_step=led.resume_step, **kw)
    return led


def synced(device: int, step: int, ids, generation: int = 0, loss: float = 1.0) -> Synced:
    return Synced(device, generation, step, loss, tuple(ids), 0.1)


def started(led: Ledger) -> Ledger:
    for d in sorted(led.members):
        led.on_ready(Ready(d, led.generation))
    return led


def test_a_generation_starts_once_every_member_is_ready():
    led = ledger()
    assert led.on_ready(Ready(0, 0)) is None and led.on_ready(Ready(1, 0)) is None
    assert led.unreported() == {2}
    assert led.on_ready(Ready(2, 0)) == StartGeneration(0, 0)
    assert led.on_ready(Ready(2, 0)) is None  # started: nothing more to start


def test_a_step_commits_when_every_trainer_reported_exactly_its_samples():
    led = started(ledger())
    assert led.on_synced(synced(0, 0, [0, 1], loss=0.25)) is None
    assert led.unreported() == {1}
    assert led.on_synced(synced(1, 0, [3, 2], loss=0.5)) == CommitStep(0, 0.75, (0, 1, 2, 3), 0.1)
    assert led.committed == 0 and led.next_step == 1 and not led.finished


def test_the_last_commit_finishes_the_job():
    led = started(ledger(steps=1))
    led.on_synced(synced(0, 0, [0, 1]))
    led.on_synced(synced(1, 0, [2, 3]))
    assert led.finished


@pytest.mark.parametrize("ids", [[2, 3, 3], [2], [2, 3, 4]], ids=["duplicated", "lost", "foreign"])
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
    assert led.on_ready(Ready(0, 7)) is None and led.ready == set()
    assert led.on_ready(Ready(9, 0)) is None and led.ready == set()
    started(led)
    assert led.on_synced(synced(2, 0, [0, 1, 2, 3])) is None  # a member without a stage does not train
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
    assert led.on_checkpoint_saved(CheckpointSaved(0, 1, 5)) is None
    assert led.on_checkpoint_saved(CheckpointSaved(7, 1, 5)) is None  # not a writer
    assert led.on_checkpoint_saved(CheckpointSaved(1, 1, 5)) == CheckpointComplete(5, 1, (0, 1))


def test_an_intact_earlier_generation_still_completes_its_checkpoint_but_a_broken_one_never():
    led = started(ledger())
    led.publish(1, members=(0, 1, 2), trainers=(0, 1, 2), writers=(0, 1), resume_step=1)  # grown: gen 0 intact
    assert led.on_checkpoint_saved(CheckpointSaved(0, 0, 1)) == CheckpointComplete(1, 0, (0,))
    led.on_checkpoint_saved(CheckpointSaved(0, 1, 2))
    led.break_generation()
    assert led.on_checkpoint_saved(CheckpointSaved(1, 1, 2)) is None
