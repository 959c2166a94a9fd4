"""The learning rate of a global step: a linear warm-up, then constant or a cosine decay (``train.lr_schedule``).

Derived from the *global* step alone, so a run resumed at any step, on any plan, continues exactly where it left off.
"""

from __future__ import annotations

import math
from enum import StrEnum


class LrSchedule(StrEnum):
    """``train.lr_schedule``: constant, or cosine by global step after the linear warm-up."""

    constant = "constant"
    cosine = "cosine"


def learning_rate(
    step: int, *, lr: float, schedule: str, warmup_steps: int, total_steps: int, min_lr: float
) -> float:
    """The learning rate of global step ``step`` (0-based).

    Linear warm-up over the first ``warmup_steps`` steps (step ``k`` uses
    ``lr · (k + 1) / warmup_steps``), then ``constant`` keeps ``lr`` and ``cosine``
    decays from ``lr`` to ``min_lr`` along half a cosine over the remaining steps.

    Raises:
        ValueError: an unknown schedule.
    """
    if schedule not in list(LrSchedule):
        raise ValueError(f"train.lr_schedule={schedule!r}: use one of {', '.join(LrSchedule)}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def schedule_of(train) -> dict:
    """The :func:`learning_rate` keywords of a ``train`` config (``chameleon.config.TrainConfig``)."""
    return {
        "lr": train.lr, "schedule": train.lr_schedule, "warmup_steps": train.warmup_steps,
        "total_steps": train.steps, "min_lr": train.min_lr,
    }
