"""Fail-slow devices, found by their own pace against their peers', persistent over several steps.

Each step every trainer reports the seconds it computed (its forwards and backwards,
waits for its peers left out) and each idle member the time of a fixed self-test. A
trainer's *pace* is its compute over the work the plan gives it (the estimator's
:func:`~chameleon.decision.estimator.device_work`), so a rebalanced device with fewer
micro-batches is judged by its speed, not its share. Its *slowdown* is its pace over
the lower median pace of the trainers holding the same layers (its peers, so stages of
different cost never look slow to each other); a trainer with no such peer (a pipeline
without replicas) is judged against its own pace over its first ``window`` steps of the
plan (taken as its known factor's, where it was already slow). An idle member's slowdown
is its self-test's time over its time at start. A device is slow when its last
``window`` slowdowns all reach ``ratio`` (a blip of fewer steps is not a straggler),
with the median of those as its factor; it is back when its last ``window`` all stay
below ``ratio``.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Mapping


class Stragglers:
    """The verdict on every device's speed (see the module doc)."""

    def __init__(self, *, ratio: float, window: int):
        self.ratio, self.window = ratio, window
        self.history: dict[int, deque[float]] = {}
        self.alone: dict[int, list[float]] = {}  # a trainer with no peer: its paces, until its baseline stands
        self.baseline: dict[int, float] = {}  # ... then the pace it would have at full speed
        self.slow: dict[int, float] = {}  # device -> its factor, while judged slow

    def slowdowns(self, pace: Mapping[int, float], role: Mapping[int, Hashable]) -> dict[int, float]:
        """Each trainer's slowdown in a step, from its ``pace`` (compute over work) and ``role`` (its layers)."""
        by_role: dict[Hashable, list[float]] = {}
        for d, x in pace.items():
            by_role.setdefault(role.get(d), []).append(x)
        out = {}
        for d, x in pace.items():
            peers = by_role[role.get(d)]
            if len(peers) > 1:
                out[d] = x / statistics.median_low(peers)
            elif d in self.baseline:
                out[d] = x / self.baseline[d]
            else:
                seen = self.alone.setdefault(d, [])
                seen.append(x)
                if len(seen) == self.window:
                    self.baseline[d] = statistics.median(seen) / self.slow.get(d, 1.0)
        return out

    def observe(self, step_slowdowns: Mapping[int, float]) -> bool:
        """Add a step's slowdowns; return whether the verdict changed (a device found slow, or back)."""
        changed = False
        for d, x in step_slowdowns.items():
            recent = self.history.setdefault(d, deque(maxlen=self.window))
            recent.append(x)
            if len(recent) < self.window:
                continue
            if d not in self.slow and min(recent) >= self.ratio:
                self.slow[d] = statistics.median(recent)
                changed = True
            elif d in self.slow and max(recent) < self.ratio:
                del self.slow[d]
                changed = True
        return changed

    def restart(self) -> None:
        """Judge afresh from the next step (a new plan: new peers, new baselines); the verdict stands meanwhile."""
        self.history.clear()
        self.alone.clear()
        self.baseline.clear()

    def forget(self, devices) -> None:
        """Devices that are lost: no verdict on them."""
        for d in devices:
            for book in (self.history, self.alone, self.baseline, self.slow):
                book.pop(d, None)
