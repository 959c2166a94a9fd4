"""The typed messages between workers, node agents and the controller.

Workers tell their agent (over a local pipe) and the agent relays to the controller
(over an authenticated connection, or in-process on the controller's own node).
Every message names the generation it belongs to: the controller drops what a
stale generation says. Agents report on their workers (exits, hangs, positions) and
renew their lease; the controller answers with commands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chameleon.runtime.beacon import Position
from chameleon.runtime.faults import FaultSpec

# ----- worker → controller (relayed by the worker's agent) ------------------------------


@dataclass(frozen=True)
class Standby:
    """A worker is up and connected, waiting for a generation that includes it."""

    device: int
    generation: int


@dataclass(frozen=True)
class Ready:
    """A worker established ``generation``: groups connected, state in the new layout."""

    device: int
    generation: int


@dataclass(frozen=True)
class Synced:
    """A worker trained and synced ``step``: its summed loss and the samples its last stages trained."""

    device: int
    generation: int
    step: int
    loss_sum: float
    sample_ids: tuple[int, ...]
    compute_s: float
    grad_norm: float | None = None  # the global gradient norm (every trainer finds the same), when clipping


@dataclass(frozen=True)
class CheckpointSaved:
    """A worker's part of the checkpoint of ``step`` (committed steps) is on disk."""

    device: int
    generation: int
    step: int


@dataclass(frozen=True)
class Left:
    """A worker left ``generation`` because a peer failed (the controller flagged it)."""

    device: int
    generation: int
    reason: str


@dataclass(frozen=True)
class Failed:
    """A worker hit an error that is not a peer's failure; ``device_fault`` when its own device is broken."""

    device: int
    generation: int
    error: str
    traceback: str
    where: Position
    device_fault: bool = False


@dataclass(frozen=True)
class Dying:
    """A worker is about to fire an injected ``fault`` on itself (or on its node)."""

    device: int
    generation: int
    fault: FaultSpec
    t: float
    where: Position


@dataclass(frozen=True)
class FinalShards:
    """A worker's parameter shards after the last step: ``{name: (region, tensor)}``."""

    device: int
    generation: int
    shards: dict


@dataclass(frozen=True)
class Done:
    """A worker finished and is exiting cleanly."""

    device: int
    generation: int


WorkerMessage = Standby | Ready | Synced | CheckpointSaved | Left | Failed | Dying | FinalShards | Done

# ----- agent → controller ----------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """An agent registers its node: the devices it runs; ``returning`` after a fault or a restart."""

    node: int
    devices: tuple[int, ...]
    pid: int
    host: str
    host_id: str
    config: dict
    returning: bool = False
    generation: int = -1


@dataclass(frozen=True)
class Lease:
    """An agent renews its lease and reports its workers' positions and progress counters."""

    node: int
    generation: int
    positions: dict[int, tuple[Position, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Exited:
    """A worker process ended, at ``t_fault`` (when a fault was injected or a fence delivered, else
    the last heartbeat it was seen alive at: ``t_fault_source`` says which)."""

    device: int
    generation: int
    exitcode: int | None
    where: Position
    t_fault: float
    t_fault_source: str


@dataclass(frozen=True)
class Hung:
    """A worker's heartbeat stopped for ``silent_s`` (stopped or wedged): the controller decides to fence it."""

    device: int
    generation: int
    where: Position
    silent_s: float
    t_last: float


AgentMessage = Hello | Lease | Exited | Hung

# ----- controller → agent ----------------------------------------------------------------


@dataclass(frozen=True)
class Renew:
    """The controller renews an agent's lease."""

    generation: int


@dataclass(frozen=True)
class Start:
    """Start (or restart) the workers of ``devices``, each arming its ``faults``."""

    generation: int
    devices: tuple[int, ...]
    faults: tuple[FaultSpec, ...] = ()


@dataclass(frozen=True)
class Inject:
    """Fire ``fault`` now from outside the victim (a fault at a wall-clock time, or during a decision)."""

    generation: int
    fault: FaultSpec


@dataclass(frozen=True)
class Welcome:
    """The controller admits a node: the job's config, where its store is, and the workers to start."""

    node: int
    generation: int
    config: dict
    store_port: int
    run_dir: str
    start: Start


@dataclass(frozen=True)
class Signal:
    """Send ``signum`` to the worker of ``device`` (fencing, or an injected fault)."""

    generation: int
    device: int
    signum: int
    why: str


@dataclass(frozen=True)
class Shutdown:
    """The job is over (or the node is refused): stop every worker within ``grace_s`` and exit."""

    generation: int
    why: str
    grace_s: float = 0.0


ControllerMessage = Welcome | Renew | Start | Inject | Signal | Shutdown
