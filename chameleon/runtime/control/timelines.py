"""The timelines of a recovery, a growth and a reshape, from what set each off to the first step committed after
it; each is recorded in ``events.jsonl`` and ``summary.json`` (:meth:`record`)."""

from __future__ import annotations

from dataclasses import dataclass

from chameleon.decision.selector import Decision


@dataclass
class Recovery:
    """Timeline of one fault, from the fault to the first step committed after it."""

    failed: list[int]
    cause: str
    step: int
    t_fault: float
    t_detect: float
    t_fault_source: str
    where: dict[int, dict]
    t_decided: float = 0.0
    t_published: float = 0.0
    t_started: float = 0.0
    t_first_commit: float = 0.0
    decision: Decision | None = None
    manifest_bytes: int = 0
    manifest_rounds: int = 0
    estimated_step_s: float = 0.0
    first_step_s: float | None = 0.0  # None: no step followed (a fault in the last validation)
    steady_step_s: float | None = None  # the median of the first steady steps after it (warm-up left out)

    def record(self) -> dict:
        return {
            "failed_ranks": self.failed, "cause": self.cause, "step": self.step, "where": self.where,
            "chosen": self.decision.choice, "t_fault_source": self.t_fault_source,
            "detect_s": self.t_detect - self.t_fault, "decide_s": self.t_decided - self.t_detect,
            "publish_s": self.t_published - self.t_decided,
            "restore_s": self.t_started - self.t_decided, "redo_s": self.t_first_commit - self.t_started,
            "total_s": self.t_first_commit - self.t_fault, "manifest_bytes": self.manifest_bytes,
            "manifest_rounds": self.manifest_rounds, "first_step_s": self.first_step_s,
            "estimated_step_s": self.estimated_step_s, "steady_step_s": self.steady_step_s, "d_s": self.decision.d_s,
        }


@dataclass
class Growth:
    """Timeline of a re-join, from the devices' return to the first step committed on the grown plan."""

    devices: list[int]
    t_back: float
    t_decided: float = 0.0
    t_switch: float = 0.0
    t_started: float = 0.0
    t_first_commit: float = 0.0
    decision: Decision | None = None
    plan: str = ""
    manifest_bytes: int = 0
    estimated_step_s: float = 0.0

    def record(self) -> dict:
        return {
            "devices": self.devices, "chosen": self.decision.choice, "plan": self.plan,
            "decide_s": self.t_decided - self.t_back, "switch_wait_s": self.t_switch - self.t_decided,
            "restore_s": self.t_started - self.t_switch, "first_step_s": self.t_first_commit - self.t_started,
            "total_s": self.t_first_commit - self.t_back, "manifest_bytes": self.manifest_bytes,
            "estimated_step_s": self.estimated_step_s,
        }


@dataclass
class Reshape:
    """Timeline of a decision on slow devices (``speeds``; empty: all back to speed), from the verdict to the first
    step committed on the plan it chose (none, when it tolerates)."""

    speeds: dict[int, float]
    step: int
    t_judged: float
    t_decided: float = 0.0
    t_switch: float = 0.0
    t_started: float = 0.0
    t_first_commit: float = 0.0
    decision: Decision | None = None
    plan: str = ""
    estimated_step_s: float = 0.0
    first_step_s: float = 0.0

    def record(self) -> dict:
        return {
            "slow": {str(d): f for d, f in sorted(self.speeds.items())}, "step": self.step,
            "chosen": self.decision.choice, "plan": self.plan, "decide_s": self.t_decided - self.t_judged,
            "switch_wait_s": self.t_switch - self.t_decided if self.t_switch else None,
            "restore_s": self.t_started - self.t_switch if self.t_switch else None,
            "estimated_step_s": self.estimated_step_s, "first_step_s": self.first_step_s,
        }
