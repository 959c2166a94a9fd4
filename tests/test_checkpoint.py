"""Checkpoints: per-device writers, commit, pruning, and resharded loads against the full tensors."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from chameleon.faults.inject import rot
from chameleon.layout.geometry import LostStateError, writers
from chameleon.layout.plan import Pipeline, Plan, Stage, even_plan, plan_from_spec
from chameleon.layout.spec import Layout, TensorSpec, device_holdings, layout_of
from chameleon.model.config import ModelConfig
from chameleon.model.llama import TP_RULES, param_shapes, stage_param_names
from chameleon.runtime.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    DamagedCheckpoint,
    checkpoint_at,
    commit_checkpoint,
    config_digest,
    latest_checkpoint,
    load_regions,
    set_aside,
    step_dir,
    verify_checkpoint,
    whole_checkpoint,
)

CFG = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)
SHAPES = param_shapes(CFG)
CONFIG = {"model": {"dim": 32, "n_layers": 4}}
KINDS = ("param", "exp_avg", "exp_avg_sq")


def layout(plan: Plan) -> Layout:
    return layout_of(plan, SHAPES, partial(stage_param_names, CFG), rules=TP_RULES)


def even(*, dp: int, pp: int, tp: int) -> Layout:
    return layout(even_plan(dp=dp, pp=pp, tp=tp, n_layers=CFG.n_layers, global_batch=4, micro_batch=1))


LAYOUT_A = even(dp=2, pp=2, tp=2)
ONE_PIPELINE_3_STAGES = layout(
    plan_from_spec([{"layers": [1, 1, 2], "micro_batches": 4}], tp=1, n_layers=4, global_batch=4, micro_batch=1)
)
PP2_TP3 = even(dp=1, pp=2, tp=3)  # wq/wo split 11/11/10, wk/wv 6/6/4
MIXED_TP = layout(
    Plan(
        n_layers=4,
        micro_batch_size=1,
        pipelines=(
            Pipeline((Stage((0, 1), (0, 2)), Stage((2, 3, 4), (2, 4))), micro_batches=2),
            Pipeline((Stage((5,), (0, 4)),), micro_batches=2),
        ),
    )
)


def box(region) -> tuple[slice, ...]:
    """Reference indexing of a global region in a full tensor."""
    return tuple(slice(start, stop) for start, stop in region)


def full_state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {kind: {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()} for kind in KINDS}


def save(root: Path, lay: Layout, full, *, step: int, committed_steps: int) -> dict[int, CheckpointWriter]:
    """Every writer device of ``lay`` saves its shards of ``full`` concurrently; returns once all are on disk."""
    started = {}
    for device, regions in writers(lay).items():
        shards = {kind: {name: full[kind][name][box(r)] for name, r in regions.items()} for kind in KINDS}
        w = CheckpointWriter(root, device=device)
        w.save_async(step, shards, regions=regions, committed_steps=committed_steps)
        started[device] = w
    for w in started.values():
        w.wait()
    return started


def save_and_commit(root: Path, full, *, step: int, keep: int = 2) -> Path:
    devices = save(root, LAYOUT_A, full, step=step, committed_steps=step)
    return commit_checkpoint(root, step, expected_devices=devices, shapes=SHAPES, config=CONFIG, keep=keep)


@pytest.mark.parametrize("lay", [LAYOUT_A, ONE_PIPELINE_3_STAGES, PP2_TP3, MIXED_TP])
def test_writers_tile_every_tensor_exactly_once_from_held_shards(lay):
    held = device_holdings(lay)
    count = {name: torch.zeros(shape, dtype=torch.int64) for name, shape in SHAPES.items()}
    for device, regions in writers(lay).items():
        for name, region in regions.items():
            assert held[device][name] == region
            count[name][box(region)] += 1
    for name, c in count.items():
        assert torch.equal(c, torch.ones_like(c)), name


def test_writers_refuse_a_tensor_nobody_holds():
    lost = {"norm": TensorSpec("norm", (32,), ())}
    with pytest.raises(LostStateError, match="norm"):
        writers(lost)


@pytest.mark.parametrize("target", [LAYOUT_A, ONE_PIPELINE_3_STAGES, PP2_TP3], ids=["same", "pp3-tp1", "pp2-tp3"])
def test_load_reshards_bit_exactly(tmp_path, target):
    full = full_state(0)
    save_and_commit(tmp_path, full, step=7)
    info = latest_checkpoint(tmp_path)
    assert (info.step, info.committed_steps, info.config_digest) == (7, 7, config_digest(CONFIG))
    for device, needs in device_holdings(target).items():
        loaded = load_regions(info, needs)
        assert set(loaded) == set(KINDS)
        for kind in KINDS:
            assert loaded[kind].keys() == needs.keys()
            for name, region in needs.items():
                assert torch.equal(loaded[kind][name], full[kind][name][box(region)]), (device, kind, name)


def test_load_opens_only_the_files_it_needs_once_each(tmp_path, monkeypatch):
    save_and_commit(tmp_path, full_state(1), step=1)
    opened = []
    real_load = torch.load

    def recording_load(path, **kwargs):
        opened.append(Path(path).name)
        return real_load(path, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    first_stage = device_holdings(ONE_PIPELINE_3_STAGES)[0]  # tok_embeddings + layer 0: stage 0 of A, devices 0 and 1
    load_regions(latest_checkpoint(tmp_path), first_stage)
    assert sorted(opened) == ["gen0_device_0.pt", "gen0_device_1.pt"]


def test_save_snapshots_before_returning(tmp_path):
    full = full_state(2)
    original = {kind: {n: t.clone() for n, t in ts.items()} for kind, ts in full.items()}
    regions = writers(LAYOUT_A)[0]
    shards = {kind: {name: full[kind][name][box(r)] for name, r in regions.items()} for kind in KINDS}
    w = CheckpointWriter(tmp_path, device=0)
    w.save_async(3, shards, regions=regions, committed_steps=3)
    for ts in shards.values():
        for t in ts.values():
            t.add_(1.0)  # training goes on while the write is in flight
    w.wait()
    assert not w.pending
    stored = torch.load(step_dir(tmp_path, 3) / "gen0_device_0.pt", weights_only=True)
    for kind in KINDS:
        for name, region in regions.items():
            assert torch.equal(stored[kind][name], original[kind][name][box(region)])


def test_latest_ignores_uncommitted_newer_steps(tmp_path):
    assert latest_checkpoint(tmp_path / "none") is None
    full = full_state(3)
    save_and_commit(tmp_path, full, step=10)
    save(tmp_path, LAYOUT_A, full, step=20, committed_steps=20)  # every file written, never committed
    step_dir(tmp_path, 30).mkdir()
    (step_dir(tmp_path, 30) / ".gen0_device_0.pt.tmp").write_bytes(b"torn")  # a writer killed mid-save
    info = latest_checkpoint(tmp_path)
    assert (info.path, info.step, info.committed_steps) == (step_dir(tmp_path, 10), 10, 10)
    marker_time = (info.path / "COMPLETE").stat().st_mtime
    assert 0 <= info.age_s <= time.time() - marker_time


def test_commit_prunes_to_the_newest_keep_and_spares_saves_in_flight(tmp_path):
    full = full_state(4)
    save_and_commit(tmp_path, full, step=1)
    save(tmp_path, {n: LAYOUT_A[n] for n in ("norm",)}, full, step=2, committed_steps=2)  # crashed: never committed
    save_and_commit(tmp_path, full, step=3)
    save(tmp_path, LAYOUT_A, full, step=5, committed_steps=5)  # still in flight when step 4 commits
    save_and_commit(tmp_path, full, step=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004", "step_00000005"]
    assert latest_checkpoint(tmp_path).step == 4
    save_and_commit(tmp_path, full, step=6, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006"]
    with pytest.raises(ValueError, match="keep must be ≥ 1"):
        save_and_commit(tmp_path, full, step=7, keep=0)


def test_metadata_records_every_file_and_shape(tmp_path):
    directory = save_and_commit(tmp_path, full_state(5), step=2)
    meta = json.loads((directory / "metadata.json").read_text())
    assert meta["step"] == meta["committed_steps"] == 2
    assert meta["kinds"] == sorted(KINDS)
    assert meta["shapes"] == {n: list(s) for n, s in SHAPES.items()}
    assert meta["config"] == CONFIG
    assert {f: e["regions"] for f, e in meta["files"].items()} == {
        f"gen0_device_{d}.pt": json.loads(json.dumps(regions)) for d, regions in writers(LAYOUT_A).items()
    }
    assert (directory / "COMPLETE").exists()


def test_commit_refuses_a_missing_file_or_an_untiled_tensor(tmp_path):
    full = full_state(6)
    devices = save(tmp_path, LAYOUT_A, full, step=1, committed_steps=1)
    with pytest.raises(CheckpointError, match="device 9 has not written"):
        commit_checkpoint(tmp_path, 1, expected_devices=[*devices, 9], shapes=SHAPES, config=CONFIG)
    with pytest.raises(CheckpointError, match="layers.0.attention.wq: the writers stored 512 of its 1024"):
        commit_checkpoint(tmp_path, 1, expected_devices=[0], shapes=SHAPES, config=CONFIG)
    assert latest_checkpoint(tmp_path) is None


def test_load_names_the_tensor_it_cannot_cover(tmp_path):
    save_and_commit(tmp_path, full_state(7), step=1)
    info = latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"tensor layers.9.attention.wq: .* \(it is not in the checkpoint\)"):
        load_regions(info, {"norm": ((0, 32),), "layers.9.attention.wq": ((0, 32), (0, 32))})
    with pytest.raises(CheckpointError, match=r"tensor output: 32 of the 2080 .*stored shape is \(64, 32\)"):
        load_regions(info, {"output": ((0, 65), (0, 32))})


def test_write_error_surfaces_from_wait(tmp_path):
    root = tmp_path / "a_file"
    root.write_text("not a directory")
    w = CheckpointWriter(root, device=0)
    w.save_async(1, {"param": {"norm": torch.ones(32)}}, regions={"norm": ((0, 32),)}, committed_steps=1)
    with pytest.raises(CheckpointError, match="device 0: writing its checkpoint failed") as err:
        w.wait()
    assert isinstance(err.value.__cause__, OSError)
    w.wait()  # the error is raised once


def test_a_committed_checkpoint_is_never_rewritten(tmp_path):
    save_and_commit(tmp_path, full_state(8), step=1)
    w = CheckpointWriter(tmp_path, device=0)
    with pytest.raises(CheckpointError, match="already complete"):
        w.save_async(1, {"param": {"norm": torch.ones(32)}}, regions={"norm": ((0, 32),)}, committed_steps=1)
    with pytest.raises(CheckpointError, match="has shape"):
        w.save_async(2, {"param": {"norm": torch.ones(31)}}, regions={"norm": ((0, 32),)}, committed_steps=2)


def test_bytes_changed_in_a_committed_shard_are_caught_and_the_newest_whole_checkpoint_is_used(tmp_path):
    full = full_state(9)
    save_and_commit(tmp_path, full, step=8)
    newest = save_and_commit(tmp_path, full, step=12)
    shard = max(newest.glob("*.pt"), key=lambda p: p.stat().st_size)
    rot(shard)
    info = latest_checkpoint(tmp_path)
    assert info.step == 12  # the COMPLETE marker is still there: only the checksums tell
    torch.load(shard, mmap=True, weights_only=True)  # and the file still loads
    whole = {name: ((0, n), *((0, m) for m in rest)) for name, (n, *rest) in SHAPES.items()}
    with pytest.raises(DamagedCheckpoint, match=f"{shard} is damaged: its .* does not match the checksum"):
        load_regions(info, whole)
    with pytest.raises(DamagedCheckpoint, match=str(shard)):
        verify_checkpoint(info, SHAPES)
    found, damaged = whole_checkpoint(tmp_path, SHAPES)
    assert found.step == 8 and [d for d, _ in damaged] == [newest] and str(shard) in damaged[0][1]
    loaded = load_regions(found, whole)
    for kind in KINDS:
        for name in SHAPES:
            assert torch.equal(loaded[kind][name], full[kind][name])


def test_whole_checkpoint_finds_none_when_every_one_is_damaged_and_refuses_another_model(tmp_path):
    assert whole_checkpoint(tmp_path, SHAPES) == (None, [])
    only = save_and_commit(tmp_path, full_state(10), step=4)
    with pytest.raises(CheckpointError, match="belongs to another model"):
        whole_checkpoint(tmp_path, {**SHAPES, "norm": (31,)})
    (only / "metadata.json").write_text("{")
    found, damaged = whole_checkpoint(tmp_path, SHAPES)
    assert found is None and len(damaged) == 1 and "metadata.json is unreadable" in damaged[0][1]
    assert set_aside(only) == tmp_path / "step_00000004.damaged" and latest_checkpoint(tmp_path) is None


def test_checkpoint_at_names_a_step_that_is_no_longer_complete(tmp_path):
    directory = save_and_commit(tmp_path, full_state(11), step=3)
    assert checkpoint_at(tmp_path, 3).path == directory
    (directory / "COMPLETE").unlink()
    with pytest.raises(DamagedCheckpoint, match="no longer a complete checkpoint"):
        checkpoint_at(tmp_path, 3)


def test_a_format_1_checkpoint_without_checksums_still_loads(tmp_path):
    full = full_state(12)
    directory = save_and_commit(tmp_path, full, step=2)
    meta = json.loads((directory / "metadata.json").read_text())
    for entry in meta["files"].values():
        del entry["checksums"]
    (directory / "metadata.json").write_text(json.dumps({**meta, "format": 1}))
    info = latest_checkpoint(tmp_path)
    verify_checkpoint(info, SHAPES)
    assert torch.equal(load_regions(info, {"norm": ((0, 32),)})["param"]["norm"], full["param"]["norm"])
