"""Structured configs of the simulator (Hydra groups ``sim`` and ``trace``)."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("chameleon", "reroute", "dynamic", "dynamic_naive", "redundant", "checkpoint", "torchft", "oracle")


@dataclass
class TraceConfig:
    """Where faults and re-joins come from.

    ``poisson``: every device fails after an exponential time with mean
    ``device_mtbf_h`` and every node (``cluster.devices_per_node`` devices at once)
    after one with mean ``node_mtbf_h``; a failed device returns ``repair_h`` later.
    ``oobleck``: Oobleck's traces, one node (``node_size`` devices) removed every
    ``interval_s`` for ``n_removals`` removals, nodes drawn by ``seed``.
    ``csv``: an Oobleck-format file (``ms,add|remove,nodeX``) at ``path``.
    ``none``: no fault.
    """

    kind: str = "poisson"  # poisson | oobleck | csv | none
    seed: int = 0
    device_mtbf_h: float = 50_000.0
    node_mtbf_h: float | None = None
    repair_h: float | None = 4.0  # None: failed devices never return
    interval_s: float = 3600.0
    n_removals: int = 15
    node_size: int = 1  # devices per trace node (oobleck, csv)
    path: str | None = None


@dataclass
class SimConfig:
    """What to simulate: horizon, policies and outputs.

    ``initial=recipe`` starts from ``parallel.*`` (the recipe's plan);
    ``initial=planner`` from the planner's best plan on all ``cluster.n_devices``.
    ``redundant_hidden`` is the fraction of the Bamboo-like shadow forward that
    pipeline bubbles hide (0: every stage pays its successor's forward in full).
    """

    horizon_h: float = 24.0
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    initial: str = "recipe"  # recipe | planner
    redundant_hidden: float = 0.0
    plots: bool = True
    progress: bool = True
