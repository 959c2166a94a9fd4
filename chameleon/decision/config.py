"""Structured configs of the decision centre (Hydra groups ``cluster``, ``policy`` and key ``plan``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


@dataclass
class ClusterConfig:
    """The hardware the decision centre plans for.

    ``kind=local`` profiles this machine for real (cached); ``kind=analytic`` derives
    a profile from the datasheet figures below, for hardware we cannot run.
    """

    name: str = "local"
    kind: str = "local"  # local | analytic
    n_devices: int = 8
    devices_per_node: int = 8
    peak_tflops: float = 0.0  # dense bf16/fp16 TFLOP/s per device (analytic)
    mfu: float = 0.45  # achievable fraction of peak (analytic)
    memory_gb: float | None = None  # per device; None: this host's RAM / n_devices (local)
    # What a device holds besides the plan's tensors (layout/memory.py's DeviceOverheads): the runtime's context and
    # its libraries' workspaces, each communicator's buffers, and the allocator's reserve as a fraction of the peak.
    context_gb: float = 0.0
    communicator_gb: float = 0.0
    allocator_reserve: float = 0.0
    hbm_gbps: float = 0.0  # device memory bandwidth, bounds the optimizer step (analytic)
    intra_gbps: float = 0.0  # per-direction link bandwidth inside a node (analytic)
    inter_gbps: float = 0.0  # per-device network bandwidth between nodes (analytic)
    latency_us: float = 10.0  # per message (analytic)
    group_create_ms: float = 50.0  # one process-group creation (analytic)
    checkpoint_gbps: float = 2.0  # aggregate storage read bandwidth for a checkpoint reload
    restart_s: float = 60.0  # relaunch + re-initialisation on checkpoint restart
    dtype: str = "bf16"  # analytic: the compute dtype peak_tflops is quoted for (local profiles measure fp32)
    comm_procs: int = 3  # gloo processes for the local comm measurement (2..4)
    cache_dir: str = "~/.cache/chameleon/profiles"


class Policy(StrEnum):
    """``policy.name``: Eq. 8 picks the recovery (``chameleon``), or one strategy is forced."""

    chameleon = "chameleon"
    reroute = "reroute"
    dynamic = "dynamic"
    redundant = "redundant"
    checkpoint = "checkpoint"


@dataclass
class PolicyConfig:
    """How the selector chooses and what the planner may search.

    ``name`` forces one strategy or lets Eq. 8 pick (``chameleon``). ``D``, the time to
    the next fault, is ``fixed_d_s`` when set, else the Gamma–Poisson posterior
    estimate from the fault history with an MTBF prior worth ``prior_faults`` faults.
    """

    name: Policy = Policy.chameleon  # chameleon | reroute | dynamic | redundant | checkpoint
    mtbf_prior_s: float = 6 * 3600.0
    prior_faults: float = 2.0
    fixed_d_s: float | None = None
    reroute_slots: str = "max"  # rerouted plans: Eq. 13 over stages (max | sum), or the runtime's schedule
    dp_degrees: list[int] = field(default_factory=list)  # allowed pipeline counts; empty = all
    pp_lengths: list[int] = field(default_factory=list)  # allowed pipeline lengths; empty = 1..n_layers
    precompute: bool = True  # plan every single next fault ahead of time
    decide_budget_s: float | None = 3.0  # a live decision's plan searches stop here with their best (None: unbounded)


@dataclass
class PlanQueryConfig:
    """``python -m chameleon.plan``: which devices failed, and how to print."""

    failed: list[int] = field(default_factory=lambda: [1])
    json: bool = False
    checkpoint_age_s: float | None = None  # seconds since the last checkpoint; None = no checkpoint
    checkpoint_interval_s: float | None = None  # seconds between checkpoints; None = none scheduled
    fault_times_s: list[float] = field(default_factory=list)  # earlier faults, seconds since start
    elapsed_s: float = 0.0  # training time so far (for the D estimate)
