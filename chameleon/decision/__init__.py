"""Decision centre: profiler, estimator (Eqs. 9–14), planner (Algorithm 1) and selector (Eq. 8).

Pure functions over plans and profiles; nothing here imports the runtime.
"""

from __future__ import annotations

from chameleon.decision.config import ClusterConfig, PlanQueryConfig, PolicyConfig
from chameleon.decision.estimator import StepEstimate, estimate_step, memory_per_device
from chameleon.decision.planner import Planner, PlannerResult, precompute_single_faults
from chameleon.decision.profiler import Profile, load_profile
from chameleon.decision.selector import Candidate, Decision, decide, estimate_d

__all__ = [
    "Candidate", "ClusterConfig", "Decision", "PlanQueryConfig", "Planner", "PlannerResult", "PolicyConfig",
    "Profile", "StepEstimate", "decide", "estimate_d", "estimate_step", "load_profile", "memory_per_device",
    "precompute_single_faults",
]
