"""Every second of a run accounted for: the one vocabulary of a run's time, real or simulated.

A run's wall time splits into these parts (``time_breakdown_s`` in ``summary.json``,
summing to ``wall_s``):

- ``productive``: training at the best full plan's rate (each committed step up to that
  plan's step time);
- ``degraded``: the rest of those steps — training below that rate (a smaller or
  rerouted plan after a fault, a slow device);
- ``detection``: from a fault to its detection;
- ``decision``: choosing how to go on (Eq. 8);
- ``restore``: from the decision to training again (groups rebuilt, state moved or
  reloaded, a restart);
- ``redone``: training that was thrown away (steps a reload rolled back, steps replayed);
- ``checkpoint``: training stalled on checkpoint writes;
- ``evaluation``: validation losses;
- ``startup``: from the launch to the first step;
- ``shutdown``: from the last step to the end (the last validation excepted: evaluation).

The effective-training-time ratio is ``productive ÷ wall`` (:func:`ettr`).
"""

from __future__ import annotations

from collections.abc import Mapping

TIME_PARTS = ("productive", "degraded", "detection", "decision", "restore", "redone", "checkpoint", "evaluation",
              "startup", "shutdown")


def ettr(parts: Mapping[str, float]) -> float:
    """The effective-training-time ratio: productive time over the whole (0 for an empty run)."""
    total = sum(parts.values())
    return parts.get("productive", 0.0) / total if total > 0 else 0.0


def empty() -> dict[str, float]:
    """Every part at zero, in :data:`TIME_PARTS` order."""
    return dict.fromkeys(TIME_PARTS, 0.0)


Span = tuple[str, float, float]
"""A part of :data:`TIME_PARTS` over ``[start, end)`` (wall-clock seconds) that is not training."""

PRIORITY = ("detection", "decision", "restore", "redone", "evaluation", "checkpoint")  # who claims overlapping time


def split_wall(*, t0: float, t_train: float | None, t_end: float, commits: list[tuple[int, float]],
               spans: list[Span], step_s: float) -> dict[str, float]:
    """The run's wall time ``[t0, t_end)`` in :data:`TIME_PARTS`, summing to ``t_end − t0``.

    ``commits``: every commit as ``(step, wall time)`` in order (a step committed again
    after a reload: its earlier commits are ``redone``); the time between commits,
    less the ``spans`` in it (claimed in :data:`PRIORITY` order where they overlap), is
    the step's training: ``productive`` up to ``step_s`` (the best full plan's step
    time), ``degraded`` beyond. Before the first step is ``startup``; after the last
    commit, what no span claims is ``shutdown``.
    """
    parts = empty()
    start = t_train if t_train is not None else t_end
    parts["startup"] = start - t0
    final = {step: i for i, (step, _) in enumerate(commits)}  # the index of each step's last commit
    edges = [start, *(t for _, t in commits)]
    for i, (step, end) in enumerate(commits):
        claimed = _claim(edges[i], end, spans, parts)
        training = max(end - edges[i] - claimed, 0.0)
        if final[step] == i:
            parts["productive"] += min(training, step_s)
            parts["degraded"] += training - min(training, step_s)
        else:
            parts["redone"] += training
    tail = _claim(edges[-1], t_end, spans, parts)
    parts["shutdown"] += max(t_end - edges[-1] - tail, 0.0)
    return parts


def _claim(lo: float, hi: float, spans: list[Span], parts: dict[str, float]) -> float:
    """Add to ``parts`` what ``spans`` claim of ``[lo, hi)``, each second once (:data:`PRIORITY` first); their sum."""
    free = [(lo, hi)] if hi > lo else []
    total = 0.0
    for part in PRIORITY:
        for name, a, b in spans:
            if name != part:
                continue
            kept = []
            for x, y in free:
                s, e = max(x, a), min(y, b)
                if s < e:
                    parts[part] += e - s
                    total += e - s
                    kept += [seg for seg in ((x, s), (e, y)) if seg[1] > seg[0]]
                else:
                    kept.append((x, y))
            free = kept
    return total
