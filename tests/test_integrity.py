"""No step that is not finite is committed: a corrupt gradient is replayed and its device named; a run that
diverges stops naming the step and its samples. Real workers, compared with the single-process reference."""

from __future__ import annotations

import json

import pytest
from conftest import SMALL_RUN, assert_nothing_lost, committed, run_entry

DP2_PP2 = ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2")  # pipe0 on devices 0, 1; pipe1 on 2, 3


def events(run) -> list[dict]:
    return [json.loads(x) for x in (run.run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.full
@pytest.mark.parametrize("on_corrupt", ["replay", "evict"])
def test_a_nan_in_one_workers_gradients_is_replayed_never_committed_and_its_device_named(tmp_path, reference_run,
                                                                                         on_corrupt):
    run = run_entry("train", tmp_path / "run", *SMALL_RUN, *DP2_PP2, "failure=corrupt", "failure.rank=1",
                    "failure.step=3", f"ft.on_corrupt={on_corrupt}", "policy.name=dynamic")
    got = assert_nothing_lost(run, reference_run)  # the failure-free losses, samples and parameters
    log = events(run)
    (bad,) = [e for e in log if e["event"] == "not_finite"]
    assert bad["step"] == 3 and bad["corrupt"] == [1] and bad["replay"]
    (replayed,) = [e for e in log if e["event"] == "replayed"]
    assert replayed["step"] == 3 and replayed["suspects"] == [1] and replayed["evicted"] == (on_corrupt == "evict")
    assert "chameleon: step 3 is not finite (" in run.stderr and "devices [1] not finite before the sync" in run.stderr
    assert ("devices [1], whose own gradients were not finite, " + ("are evicted" if on_corrupt == "evict" else
            "stay (ft.on_corrupt=replay)")) in run.stderr
    assert sorted(committed(run)) == list(range(6)), "every step committed once, step 3 only after its replay"
    if on_corrupt == "evict":
        (recovery,) = got["recoveries"]
        assert recovery["failed_ranks"] == [1] and recovery["step"] == 4
    else:
        assert got["recoveries"] == []


@pytest.mark.full
def test_a_run_that_diverges_stops_naming_the_step_and_its_samples(tmp_path):
    """A learning rate so large that the loss overflows on every device after the first update: the step is not
    finite, nor is its replay; the run stops there with one line, and nothing after the last good step commits."""
    run = run_entry("train", tmp_path / "run", *SMALL_RUN, *DP2_PP2, "train.lr=1e30", "train.lr_schedule=constant",
                    "train.warmup_steps=0")
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("chameleon: training failed: step 1 is not finite again on its replay"), last
    assert "the data or the model diverged, not a device: samples [8, 16); nothing after step 0 is committed" in last
    assert sorted(committed(run)) == [0]
    assert not run.leftover_workers()


@pytest.mark.full
def test_a_flipped_parameter_bit_on_one_replica_is_found_by_the_digests_and_the_checkpoint_arbitrates(
        tmp_path, reference_run):
    """The lowest bit of one parameter of device 3 flipped after step 3's commit: finite, so only the replicas'
    digests can tell. Device 1, the other holder of those layers, disagrees at the next step and there is no
    majority: both are lost, the step is not committed, and the newest checkpoint (written by pipeline 0's
    devices, not the corrupted replica) restores the layers; the run ends at the failure-free losses."""
    run = run_entry("train", tmp_path / "run", *SMALL_RUN, *DP2_PP2, "failure=corrupt", "failure.rank=3",
                    "failure.step=3", "failure.target=param", "failure.value=flip", "failure.phase=optimizer",
                    "ft.digest_interval=1", "ckpt.interval=2")
    got = assert_nothing_lost(run, reference_run)
    (disagreement,) = [e for e in events(run) if e["event"] == "disagreement"]
    assert disagreement["step"] == 4 and disagreement["outvoted"] == [1, 3]
    (recovery,) = got["recoveries"]
    assert recovery["failed_ranks"] == [1, 3] and recovery["chosen"] == "checkpoint"
    assert "chameleon: replicas disagree before step 4: devices [1, 3] are outvoted" in run.stderr


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory):
    """The single-process reference of SMALL_RUN's model and data over 8 steps."""
    run = run_entry("train", tmp_path_factory.mktemp("ref8") / "run", *SMALL_RUN, "train.steps=8",
                    "launcher.nproc_per_node=1")
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.full
def test_a_damaged_checkpoint_met_by_an_in_run_restore_falls_back_to_the_newest_whole_one(tmp_path, eight_steps):
    """Device 0's disk rots every checkpoint shard it writes from step 4 on. Both replicas of stage 0 are killed in
    step 7, so only a checkpoint holds layers 0-1: the newest is damaged, a worker restoring it says so, and the
    controller decides again with the one before it, until one is whole (step 2); the run ends at the failure-free
    losses."""
    faults = ("{kind:corrupt,rank:0,step:4,phase:optimizer,target:checkpoint,value:flip},"
              "{kind:kill,rank:0,step:7,phase:forward},{kind:kill,rank:2,step:7,phase:forward}")
    run = run_entry("train", tmp_path / "run", *SMALL_RUN, *DP2_PP2, "train.steps=8", "ckpt.interval=2",
                    "ckpt.keep=3", "failure=schedule", f"failure.faults=[{faults}]")
    got = assert_nothing_lost(run, eight_steps)
    damaged = [e for e in events(run) if e["event"] == "damaged_checkpoint"]
    assert damaged and [e["fallback"] for e in damaged][-1] == 2, damaged
    assert all("gen0_device_0.pt is damaged" in e["why"] for e in damaged)
    (recovery,) = got["recoveries"]
    assert recovery["chosen"] == "checkpoint" and "damaged" in recovery["cause"]
    assert "found the checkpoint it restores damaged" in run.stderr
