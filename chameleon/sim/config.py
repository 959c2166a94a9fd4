"""Structured configs of the simulator (Hydra groups ``sim`` and ``trace``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class SimPolicy(StrEnum):
    """``sim.policies``: the systems the simulator replays a trace under (Chameleon, its oracle, its fixed
    strategies, the peers' baselines and two answers to fail-slow devices: ``tolerate`` them, or ``failstop``,
    treat each as failed)."""

    chameleon = "chameleon"
    oracle = "oracle"
    dynamic = "dynamic"
    reroute = "reroute"
    tolerate = "tolerate"
    failstop = "failstop"
    elaswave = "elaswave"
    oobleck = "oobleck"
    recycle = "recycle"
    bamboo = "bamboo"
    checkpoint = "checkpoint"
    torchft = "torchft"


class TraceKind(StrEnum):
    """``trace.kind``: where faults and re-joins come from (see :class:`TraceConfig`)."""

    poisson = "poisson"
    oobleck = "oobleck"
    csv = "csv"
    none = "none"


class Initial(StrEnum):
    """``sim.initial``: the plan every policy starts from, the recipe's or the planner's fastest even plan."""

    recipe = "recipe"
    planner = "planner"


@dataclass
class TraceConfig:
    """Where faults and re-joins come from.

    ``poisson``: every device fails after an exponential time with mean
    ``device_mtbf_h`` and every node (``cluster.devices_per_node`` devices at once)
    after one with mean ``node_mtbf_h``; a failed device returns ``repair_h`` later.
    When ``incidents`` is set, ``device_mtbf_h`` is derived from published incident
    counts instead: ``incident_devices · incident_days · 24 / incidents`` device-hours
    per fault, so the per-device rate carries over to any simulated cluster.
    ``oobleck``: Oobleck's traces, one node (``node_size`` devices) removed every
    ``interval_s`` for ``n_removals`` removals, nodes drawn by ``seed``; with
    ``repair_h`` each removed node returns that long after its removal.
    ``csv``: an Oobleck-format file (``ms,add|remove,nodeX``) at ``path``.
    ``none``: no fault.

    Any kind may add fail-slow episodes: each device slows down at exponential times, ``slow_rate_per_device_h``
    onsets per device-hour (0: none), by a time factor drawn uniformly from ``slow_factor`` ``[low, high]``, for a
    duration drawn log-uniformly from ``slow_duration_s`` ``[low, high]``, then recovers; one episode at a time.
    """

    kind: TraceKind = TraceKind.poisson  # poisson | oobleck | csv | none
    seed: int = 0
    device_mtbf_h: float = 50_000.0
    node_mtbf_h: float | None = None
    repair_h: float | None = 4.0  # None: failed devices never return
    incidents: int | None = None  # published fault count; with the two below it sets device_mtbf_h
    incident_days: float | None = None
    incident_devices: int | None = None
    interval_s: float = 3600.0
    n_removals: int = 15
    node_size: int = 1  # devices per trace node (oobleck, csv)
    path: str | None = None
    slow_rate_per_device_h: float = 0.0
    slow_factor: list[float] = field(default_factory=lambda: [1.2, 3.0])
    slow_duration_s: list[float] = field(default_factory=lambda: [30.0, 36_000.0])


@dataclass
class OobleckConfig:
    """Oobleck (SOSP'23) as its artifact runs it: fault threshold and the pipeline-template range."""

    fault_threshold: int = 3  # f: at least f+1 pipelines at start (Oobleck's examples use 3)


@dataclass
class BambooConfig:
    """Bamboo (NSDI'23) as Oobleck's artifact simulates it (``tools/simulator/bamboo_simulator.py``)."""

    hidden: float | None = None  # share of the shadow forward hidden in bubbles; None: the plan's bubble share
    reconfigure_s: float = 450.0  # local rendezvous of a reconfiguration (artifact: 450 s for GPT-3 6.7B)
    fatal_restart_s: float = 30.0  # global rendezvous after a fatal failure (artifact: 30 s)
    overload_threshold: float = 0.05  # reconfigure once 2·overloaded/active exceeds this (artifact: 5 %)


@dataclass
class TorchftConfig:
    """torchft 0.2.0: survivors wait out the stuck collective before the next quorum."""

    timeout_s: float = 60.0  # torchft.Manager's default timeout for a collective


@dataclass
class ElasWaveConfig:
    """ElasWave (arXiv 2510.00606): communicator edits within a second, migration off the critical path."""

    communicator_s: float = 1.0  # "communicator recovery completes within one second"


@dataclass
class FailstopConfig:
    """Fail-slow treated as fail-stop, the practice FALCON reports (arXiv 2410.12588): noticed by hand, then a
    checkpoint-and-restart without the slow device."""

    detect_s: float = 600.0  # an assumption: FALCON calls manual detection time-consuming but gives no figure


@dataclass
class SimConfig:
    """What to simulate: horizon, policies and outputs.

    Every policy starts from one plan: with ``initial=planner`` the planner's fastest even
    plan on the whole cluster (equal pipelines, as torchft and ReCycle replicate them), with
    ``initial=recipe`` the plan of ``parallel.*``. Bamboo and Oobleck lay out the
    cluster by their own rules (shadow stages; at least ``f+1`` templates).
    The failure-free reference of every ratio is the planner's best plan on the full
    cluster, cards allowed to idle: the best of its plans on ``n_devices − k`` cards,
    ``0 ≤ k ≤ reference_idle``.
    """

    horizon_h: float = 24.0
    policies: list[SimPolicy] = field(default_factory=lambda: list(SimPolicy))
    initial: Initial = Initial.planner  # planner | recipe
    reference_idle: int = 16
    plots: bool = True
    progress: bool = True
    oobleck: OobleckConfig = field(default_factory=OobleckConfig)
    bamboo: BambooConfig = field(default_factory=BambooConfig)
    torchft: TorchftConfig = field(default_factory=TorchftConfig)
    elaswave: ElasWaveConfig = field(default_factory=ElasWaveConfig)
    failstop: FailstopConfig = field(default_factory=FailstopConfig)
