"""Run plots and TensorBoard scalars from a run dir's metrics.jsonl and events.jsonl (a run worked by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chameleon.report.breakdown import TIME_PARTS, ettr, split_wall
from chameleon.report.run_plots import episodes, plot_run, throughput

T0 = 1000.0
BATCH = 8


def write_run(run_dir: Path, *, steps: int = 12, partial_line: bool = False) -> None:
    """Steps of 0.5 s; ranks 1 lost at 3.0 s (a second fault, rank 2, during its recovery), recovered at 4.0 s;
    rank 3 lost at 6.2 s and never recovered."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics, t = [], T0
    for step in range(steps):
        t += 0.5 + (1.0 if step == 6 else 0.0)
        metrics.append({"step": step, "loss": 5.0 - 0.1 * step, "samples_per_s": BATCH / 0.5, "tokens_per_s": 256.0,
                        "step_time_s": 0.5, "time": t, "lr": 1e-3, "grad_norm": 2.0})
    events = [
        {"event": "start", "workers": {}, "plan": ""},
        {"event": "checkpoint", "step": 4},
        {"event": "fault", "failed_ranks": [1], "step": 5, "t_fault": T0 + 3.0},
        {"event": "fault", "failed_ranks": [2], "step": 5, "t_fault": T0 + 3.4},
        {"event": "recovered", "failed_ranks": [1, 2], "cause": "SIGKILL", "step": 5, "chosen": "dynamic",
         "total_s": 1.0, "detect_s": 0.1, "restore_s": 0.3, "redo_s": 0.6},
        {"event": "fault", "failed_ranks": [3], "step": 9, "t_fault": T0 + 6.2},
        {"event": "validated", "step": 10, "val_loss": 4.5, "generation": 2, "time": T0 + 7.0},
    ]
    text = "".join(json.dumps(m) + "\n" for m in metrics)
    (run_dir / "metrics.jsonl").write_text(text + ('{"step": 99, "lo' if partial_line else ""))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_faults_are_grouped_with_their_recovery(tmp_path):
    write_run(tmp_path)
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    first, second = episodes(events)
    assert (first.step, first.failed, first.policy, first.total_s) == (5, [1, 2], "dynamic", 1.0)
    assert first.faults == [T0 + 3.0, T0 + 3.4] and first.label == "ranks 1,2 lost → dynamic, 1.00 s"
    assert (second.failed, second.policy) == ([3], None) and "not recovered" in second.label


def test_throughput_counts_committed_samples_per_window(tmp_path):
    write_run(tmp_path, steps=40)
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    edges, rate = throughput(metrics, T0 - 0.5)
    assert sum(rate * (edges[1:] - edges[:-1])) == pytest.approx(40 * BATCH)  # every sample, once
    assert rate.max() == pytest.approx(BATCH / 0.5, rel=0.1) and rate.min() < rate.max()  # the stall dips


def test_plot_is_written_and_an_empty_run_gives_none(tmp_path):
    write_run(tmp_path / "run")
    path = plot_run(tmp_path / "run")
    assert path == tmp_path / "run" / "run.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    assert plot_run(tmp_path / "empty") is None


def test_tensorboard_mirror_writes_scalars_as_lines_arrive(tmp_path):
    pytest.importorskip("tensorboard", reason="report.tensorboard needs tensorboard (pip install '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from chameleon.report.live import Mirror, tensorboard_sink

    write_run(tmp_path, steps=3, partial_line=True)
    mirror = Mirror(tmp_path, tensorboard_sink(tmp_path))
    mirror.sync()
    with (tmp_path / "metrics.jsonl").open("a") as f:  # the partial line completes, one more arrives
        f.write('ss": 1.0, "samples_per_s": 1, "step_time_s": 1, "time": 2000}\n')
    mirror.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [0, 1, 2, 99]
    assert [e.value for e in acc.Scalars("train/grad_norm")] == [2.0, 2.0, 2.0]
    assert [(e.step, e.value) for e in acc.Scalars("recovery/total_s")] == [(5, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("val/loss")] == [(10, 4.5)]


def test_wandb_mirror_runs_offline_without_a_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="report.wandb needs wandb (pip install '.[wandb]')")
    from chameleon.report.live import Mirror, WandbSink

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    write_run(tmp_path, steps=3)
    mirror = Mirror(tmp_path, WandbSink(tmp_path, {"train": {"steps": 3}}))
    mirror.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0  # what `wandb sync` would upload


def test_every_second_of_a_run_is_in_one_part():
    """Commits at 3, 4, 6 (steps 0–2), a fault at 6.5 and a reload that redoes steps 1 and 2, a validation at the
    end: the earlier commits of steps 1 and 2 and the broken step are redone, each second counted once."""
    spans = [("redone", 6.0, 6.5), ("detection", 6.5, 7.0), ("decision", 7.0, 7.5), ("restore", 7.5, 8.0),
             ("evaluation", 6.0, 8.5),  # retaken after the recovery: only what the recovery did not claim
             ("evaluation", 11.0, 12.0)]
    parts = split_wall(t0=0.0, t_train=2.0, t_end=20.0, commits=[(0, 3.0), (1, 4.0), (2, 6.0), (1, 9.0), (2, 10.0),
                                                                (3, 11.0)], spans=spans, step_s=0.8)
    assert list(parts) == list(TIME_PARTS) and sum(parts.values()) == pytest.approx(20.0)
    assert parts == pytest.approx({"productive": 3 * 0.8 + 0.5, "degraded": 3 * 0.2, "detection": 0.5, "decision": 0.5,
                                   "restore": 0.5, "redone": 3.5, "checkpoint": 0.0, "evaluation": 1.5,
                                   "startup": 2.0, "shutdown": 8.0})
    assert ettr(parts) == pytest.approx(2.9 / 20)
