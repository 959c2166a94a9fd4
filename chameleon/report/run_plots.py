"""Plots of one training run, read back from its run dir: ``python -m chameleon.report.run_plots RUN_DIR``.

``run.png`` has two panels. Loss per committed step, with the learning rate on a
second axis, each fault a red line at the step it hit and a label naming the
recovery policy and its duration. Throughput over wall time — committed samples
per window, so a recovery shows as the dip it causes — each recovery shaded from
the fault to the first step committed after it, every fault (a fault during a
recovery too) a red tick.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOT = "run.png"


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines file (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Episode:
    """One fault and what followed: the recovery policy and its duration (None when not recovered)."""

    t_fault: float
    step: int
    failed: list[int]
    faults: list[float]
    policy: str | None
    total_s: float | None

    @property
    def label(self) -> str:
        what = f"rank{'s' if len(self.failed) > 1 else ''} {','.join(map(str, self.failed))}"
        if self.policy is None:
            return f"{what} lost: not recovered in this run"
        return f"{what} lost → {self.policy}, {self.total_s:.2f} s"


def episodes(events: list[dict]) -> list[Episode]:
    """Faults grouped with the recovery that closed them (a fault during a recovery joins that recovery)."""
    out, pending = [], []
    for e in events:
        if e["event"] == "fault":
            pending.append(e)
        elif e["event"] == "recovered" and pending:
            out.append(Episode(pending[0]["t_fault"], pending[0]["step"], e["failed_ranks"],
                               [f["t_fault"] for f in pending], e["chosen"], e["total_s"]))
            pending = []
    if pending:
        failed = sorted({r for f in pending for r in f["failed_ranks"]})
        out.append(Episode(pending[0]["t_fault"], pending[0]["step"], failed, [f["t_fault"] for f in pending], None, None))
    return out


def throughput(metrics: list[dict], t0: float) -> tuple[np.ndarray, np.ndarray]:
    """Committed samples per second over seconds since ``t0``, in equal windows of at least five median steps."""
    times = np.array([m["time"] - t0 for m in metrics])
    samples = np.array([m["samples_per_s"] * m["step_time_s"] for m in metrics])
    width = max(5 * statistics.median(m["step_time_s"] for m in metrics), times[-1] / 60)
    edges = np.linspace(0.0, times[-1], max(1, round(times[-1] / width)) + 1)
    counts, _ = np.histogram(times, bins=edges, weights=samples)
    return edges, counts / np.diff(edges)


def plot_run(run_dir: Path, path: Path | None = None) -> Path | None:
    """Draw ``run.png`` (or ``path``) from ``metrics.jsonl`` and ``events.jsonl``; None when no step committed."""
    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if not metrics:
        return None
    events = read_jsonl(run_dir / "events.jsonl")
    found = episodes(events)
    t0 = metrics[0]["time"] - metrics[0]["step_time_s"]
    fig, (ax_loss, ax_rate) = plt.subplots(2, 1, figsize=(9, 6.2))
    steps = [m["step"] for m in metrics]
    ax_loss.plot(steps, [m["loss"] for m in metrics], color="tab:blue", linewidth=1.2, label="loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    if any("lr" in m for m in metrics):
        ax_lr = ax_loss.twinx()
        ax_lr.plot(steps, [m.get("lr") for m in metrics], color="tab:gray", linewidth=0.9, linestyle="--")
        ax_lr.set_ylabel("learning rate (dashed)", color="tab:gray")
    validated = [e for e in events if e["event"] == "validated"]
    if validated:
        ax_loss.plot([e["step"] for e in validated], [e["val_loss"] for e in validated], "o-", color="tab:orange",
                     markersize=3.5, linewidth=0.9, label="validation loss")
        ax_loss.legend(loc="upper right", fontsize=7)
    for e in events:
        if e["event"] == "checkpoint":
            ax_loss.axvline(e["step"] - 0.5, color="tab:green", alpha=0.35, linewidth=0.8, linestyle=":")
    for i, ep in enumerate(found):
        ax_loss.axvline(ep.step, color="red", alpha=0.7, linewidth=1.0)
        ax_loss.annotate(ep.label, xy=(ep.step, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12 - 11 * i),
                         textcoords="offset points", fontsize=7, color="red")
    ax_loss.set_title(f"{len(steps)} committed steps, {len(found)} fault{'s' * (len(found) != 1)}; "
                      "red: faults, dotted green: checkpoints", fontsize=9)

    edges, rate = throughput(metrics, t0)
    ax_rate.plot([m["time"] - t0 for m in metrics], [m["samples_per_s"] for m in metrics], ".", color="tab:gray",
                 markersize=2.5, label="each step")
    ax_rate.stairs(rate, edges, baseline=None, color="tab:blue", linewidth=1.4, label="per window")
    ax_rate.legend(fontsize=7, loc="upper right")
    for ep in found:
        start = ep.t_fault - t0
        end = start + ep.total_s if ep.total_s is not None else edges[-1]
        ax_rate.axvspan(start, end, color="red", alpha=0.15)
        for t in ep.faults:
            ax_rate.axvline(t - t0, color="red", linewidth=1.0)
        ax_rate.annotate(ep.label, xy=(end, 0.02), xycoords=("data", "axes fraction"), xytext=(3, 0),
                         textcoords="offset points", fontsize=7, color="red")
    ax_rate.set_xlabel("seconds since the first step started")
    ax_rate.set_ylabel("samples/s")
    ax_rate.set_ylim(bottom=0)
    summary = run_dir / "summary.json"
    ettr = f"effective training time {json.loads(summary.read_text())['ettr']:.1%}; " if summary.exists() else ""
    ax_rate.set_title(f"{ettr}throughput; shaded: from each fault to the first step committed after it", fontsize=9)
    fig.tight_layout()
    out = Path(path) if path else run_dir / PLOT
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(plot_run(Path(sys.argv[1])))
