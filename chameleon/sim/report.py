"""Tables and plots of simulated runs; ``python -m chameleon.sim.report DIR`` tabulates a ``--multirun`` sweep."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from chameleon.report.breakdown import TIME_PARTS  # noqa: E402
from chameleon.sim.engine import RunResult  # noqa: E402
from chameleon.sim.traces import Event  # noqa: E402

PARTS = tuple(p for p in TIME_PARTS if p not in ("evaluation", "startup"))  # the parts a simulation can have
_COLUMNS = ("policy", "samples/s", "× chameleon", "/ reference", "own failure-free / ref.", "ETTR",
            *(f"{p} %" for p in PARTS), "faults", "post/ref. 1st", "post/ref. mean", "choices")
_MARKS = {"remove": "red", "add": "green", "slow": "orange"}  # the timeline's event lines


def summary_row(run: dict, chameleon: float | None) -> list[str]:
    """One table row from :meth:`RunResult.to_dict`; ``chameleon`` is the throughput ``× chameleon`` divides."""
    faults = [r for r in run["recoveries"] if r["kind"] == "fault"]
    ratios = [r["post_over_reference"] for r in faults]
    choices: dict[str, int] = {}
    for r in run["recoveries"]:
        choices[r["choice"]] = choices.get(r["choice"], 0) + 1
    share = {k: 100 * v / run["horizon_s"] for k, v in run["breakdown"].items()}
    ref = run["reference_throughput"]
    return [
        run["policy"], f"{run['throughput']:.3f}", f"{chameleon / run['throughput']:.3f}" if chameleon and run["throughput"] else "—",
        f"{run['throughput'] / ref:.3f}", f"{run['initial_throughput'] / ref:.3f}", f"{run['ettr']:.3f}",
        *(f"{share[k]:.1f}" for k in PARTS), str(len(faults)),
        f"{ratios[0]:.3f}" if ratios else "—", f"{statistics.fmean(ratios):.3f}" if ratios else "—",
        " ".join(f"{k}×{v}" for k, v in sorted(choices.items())) + (" (halted)" if run["halted_at"] is not None else ""),
    ]


def table(runs: list[dict], *, extra: dict[str, str] | None = None) -> str:
    """A markdown table of runs on one trace.

    ``× chameleon`` is chameleon's throughput ÷ the row's; ``/ reference`` and the
    ``post/ref.`` columns divide by the reference (the planner's best failure-free
    plan on the full cluster), so none exceeds 1.
    """
    ref = next((r["throughput"] for r in runs if r["policy"] == "chameleon"), None)
    head = (*extra, *_COLUMNS) if extra else _COLUMNS
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        lines.append("| " + " | ".join([*(extra or {}).values(), *summary_row(run, ref)]) + " |")
    return "\n".join(lines)


def plot_timeline(results: list[RunResult], events: tuple[Event, ...], path: Path, *, title: str = "", bins: int = 200) -> Path:
    """Throughput over time per policy, averaged over ``bins`` equal windows; faults red, re-joins green, devices
    slowing down orange."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    edges = np.linspace(0.0, results[0].horizon_s, bins + 1)
    for res in results:
        samples = np.zeros(bins)
        for start, end, rate in res.timeline:
            overlap = np.clip(np.minimum(edges[1:], end) - np.maximum(edges[:-1], start), 0.0, None)
            samples += rate * overlap
        ax.step(edges[1:] / 3600, samples / np.diff(edges), where="pre", label=res.policy, linewidth=1.2)
    for e in events:
        if e.time_s < results[0].horizon_s and e.kind in _MARKS:
            ax.axvline(e.time_s / 3600, color=_MARKS[e.kind], alpha=0.25, linewidth=0.8)
    ax.set_xlabel("hours")
    ax.set_ylabel("samples/s")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=4, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_breakdown(runs: list[dict], path: Path, *, title: str = "") -> Path:
    """Stacked bars per policy: the share of the horizon in each part that occurs, throughput and ETTR annotated."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    bottom = [0.0] * len(runs)
    for part in (p for p in PARTS if any(r["breakdown"][p] > 0 for r in runs)):
        share = [100 * r["breakdown"][part] / r["horizon_s"] for r in runs]
        ax.bar([r["policy"] for r in runs], share, bottom=bottom, label=part)
        bottom = [b + s for b, s in zip(bottom, share)]
    for i, r in enumerate(runs):
        ax.text(i, 101, f"{r['throughput']:.1f}\n{r['ettr']:.2f}", ha="center", fontsize=6)
    ax.set_ylabel("% of horizon (samples/s, ETTR above)")
    ax.set_ylim(0, 116)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def collect(sweep_dir: Path) -> str:
    """One table over every ``summary.json`` under a ``--multirun`` sweep directory, labelled by its overrides."""
    blocks = []
    for summary in sorted(Path(sweep_dir).glob("*/summary.json"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0):
        data = json.loads(summary.read_text())
        blocks.append(table(data["runs"], extra={"overrides": " ".join(data["overrides"]) or "—"}))
    head, rows = None, []
    for block in blocks:
        lines = block.splitlines()
        head = head or lines[:2]
        rows += lines[2:]
    return "\n".join((head or []) + rows)


if __name__ == "__main__":
    print(collect(Path(sys.argv[1])))
