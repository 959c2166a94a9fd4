"""The typed messages between workers, node agents and the controller.

Everything the control plane says travels as one of these frozen dataclasses,
encoded by :mod:`chameleon.runtime.protocol.codec` (JSON and raw tensor bytes; never a
pickle). Every message names the generation it belongs to: what a stale
generation says is dropped. ``docs/protocol.md`` gives who sends what, when.

- worker → its agent (a local pipe): what the worker did (ready, synced, saved…);
- agent → controller (the authenticated link, or in-process on node 0): the
  node's workers *aggregated* — one :class:`NodeReady`, :class:`NodeSynced` or
  :class:`NodeSaved` per node, not per device — plus the rare per-device events
  (an exit, a hang, an error, a return);
- controller → agents: orders, and the *pushed* state of the job — a new
  generation (:class:`Publish`), its start (:class:`Begin`), each commit
  (:class:`Commit`), a fault (:class:`Flag`);
- agent → its workers (a local pipe, and a shared-memory board for fault flags):
  the pushed state, so a worker never polls the network while it trains.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

from chameleon.config import Config
from chameleon.faults.spec import FaultSpec
from chameleon.layout.plan import Pipeline, Plan, Recompute, Reroute, Stage
from chameleon.layout.relayout import Manifest, Move, manifest_parts
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.position import Position

Samples = tuple[tuple[int, int], ...]
"""Global sample ids as sorted, disjoint half-open ranges."""


MAX_IDS = 1 << 24  # devices a frame may list: more than any job has (a lying frame builds no huge tuple)


def _runs(ids: Iterable[int]) -> list[int]:
    """``ids`` in their order as runs of consecutive ints, flat: ``[first, count, …]`` (a plan's devices, pipeline by
    pipeline, are a few runs: placement keeps devices where they were)."""
    out: list[int] = []
    for i in ids:
        if out and out[-2] + out[-1] == i:
            out[-1] += 1
        else:
            out += (i, 1)
    return out


def _unruns(flat: list) -> tuple[int, ...]:
    counts = flat[1::2]
    if len(flat) % 2 or any(n < 1 for n in counts) or sum(counts) > MAX_IDS:
        raise ValueError(f"ids packed as other than [first, count, …] runs of at most {MAX_IDS} in all")
    return tuple(i for first, n in zip(flat[::2], counts) for i in range(first, first + n))


def sample_ranges(ids) -> Samples:
    """``ids`` as sorted, merged half-open ranges (duplicates kept apart, so the ledger sees them)."""
    flat = _runs(sorted(ids))
    return tuple((first, first + n) for first, n in zip(flat[::2], flat[1::2]))


# ----- the job's state, pushed down ---------------------------------------------------------


@dataclass(frozen=True)
class GenerationSpec:
    """One generation: its plan, its member devices, the step it resumes at, how state gets there
    (a re-layout manifest from surviving replicas, or a checkpoint root), and its checkpoint writers."""

    generation: int
    plan: Plan
    devices: tuple[int, ...]
    resume_step: int
    manifest: Manifest | None = None  # pushed apart, each node's part in a Moves before the Publish
    checkpoint: str | None = None
    writers: tuple[int, ...] = ()  # the devices that write its checkpoints
    moves: bool = False  # state moves by a manifest (its part arrives as :class:`Moves`)
    evaluated: int = -1  # the last step whose validation loss the job recorded (it is not taken again)

    @cached_property
    def device_set(self) -> frozenset[int]:
        """The members, as a set."""
        return frozenset(self.devices)


@dataclass(frozen=True)
class CommitOrder:
    """What workers do after a committed step: save a checkpoint, then go on, stop, or switch generation; or, for
    a step not committed, replay it."""

    save: bool = False
    stop: bool = False
    switch_to: int | None = None
    replay: bool = False  # the step was not finite: nothing is applied, and it is trained again


@dataclass(frozen=True)
class Moves:
    """A node's part of a generation's re-layout manifest (:func:`chameleon.layout.relayout.manifest_for`),
    pushed just before the generation's :class:`Publish`."""

    generation: int
    manifest: Manifest


@dataclass(frozen=True)
class Publish:
    """A new generation, the same for every node (its manifest travels apart, as :class:`Moves`)."""

    spec: GenerationSpec

    @property
    def generation(self) -> int:
        return self.spec.generation


@dataclass(frozen=True)
class Begin:
    """Every member of ``generation`` is ready: train from its resume step."""

    generation: int


@dataclass(frozen=True)
class Commit:
    """``step`` of ``generation`` committed: apply it (clipped by ``grad_norm``, the whole plan's), then ``order``."""

    generation: int
    step: int
    order: CommitOrder
    grad_norm: float | None
    t_published: float  # the controller's clock when it sent the commit (latency measurements)


@dataclass(frozen=True)
class Flag:
    """A member of ``generation`` was lost: abandon it."""

    generation: int


@dataclass(frozen=True)
class End:
    """The job is over: a worker waiting for a generation leaves."""

    generation: int


# ----- worker → agent -------------------------------------------------------------------------


@dataclass(frozen=True)
class Standby:
    """A worker is up, waiting for a generation that includes it."""

    device: int
    generation: int


@dataclass(frozen=True)
class Ready:
    """A worker established ``generation``: groups connected, state in the new layout."""

    device: int
    generation: int


@dataclass(frozen=True)
class Synced:
    """A worker trained and synced ``step``: its summed loss, the samples its last stages trained, and its part
    of the squared global gradient norm (when clipping)."""

    device: int
    generation: int
    step: int
    loss_sum: float
    samples: Samples
    compute_s: float
    norm_sq: float | None = None
    finite: bool = True  # its own gradients and loss were finite before the sync
    digest: int | None = None  # CRC-32 of this step's slice of its state (ft.digest_interval), as the step used it
    busy_s: float = 0.0  # of compute_s, the seconds it computed (forwards and backwards, waits left out)


@dataclass(frozen=True)
class SelfTimed:
    """A member the plan leaves idle timed its self-test as ``step`` went by: ``slowdown`` is that time over its
    time at start (how a device out of work shows that its speed is back)."""

    device: int
    generation: int
    step: int
    slowdown: float


@dataclass(frozen=True)
class Evaluated:
    """A worker's part of the validation loss before ``step`` (``step == train.steps``: after the last)."""

    device: int
    generation: int
    step: int
    loss_sum: float


@dataclass(frozen=True)
class CheckpointSaved:
    """A worker's part of the checkpoint of ``step`` (committed steps) is on disk."""

    device: int
    generation: int
    step: int


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
class Damaged:
    """The checkpoint of ``step`` a worker restores from in ``generation`` is damaged (``why`` names the file):
    the worker waits for the controller to decide again."""

    device: int
    generation: int
    step: int
    why: str


@dataclass(frozen=True)
class Dying:
    """A worker is about to fire an injected ``fault`` on itself (or, once :class:`Noted`, its agent on the node)."""

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
    """A worker finished, after ``store_ops`` operations on the controller's store, its resident memory having
    peaked at ``peak_rss`` bytes and, on an accelerator, its allocator at ``device_allocated`` bytes handed out and
    ``device_reserved`` held (0 on a CPU)."""

    device: int
    generation: int
    store_ops: int = 0
    peak_rss: int = 0
    device_allocated: int = 0
    device_reserved: int = 0


# ----- agent → controller ---------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """An agent registers its node: the devices it runs; ``returning`` after a fault or a restart."""

    node: int
    devices: tuple[int, ...]
    pid: int
    host: str
    host_id: str
    config: Config
    returning: bool = False
    generation: int = -1


@dataclass(frozen=True)
class Lease:
    """An agent that sent nothing for a lease period renews its lease."""

    node: int
    generation: int


@dataclass(frozen=True)
class NodeReady:
    """Every member of ``generation`` on the node is ready."""

    node: int
    generation: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class NodeSynced:
    """Every trainer of ``generation`` on the node synced ``step``: their summed loss, their samples, their
    slowest compute, their summed squared norm, when the last of them synced (the node's clock), and which of
    them were not finite."""

    node: int
    generation: int
    step: int
    devices: tuple[int, ...]
    loss_sum: float
    samples: Samples
    compute_s: float
    norm_sq: float | None
    t_synced: float
    corrupt: tuple[int, ...] = ()  # its trainers whose own gradients or loss were not finite before the sync
    digests: tuple[tuple[int, int], ...] = ()  # (device, digest) of its trainers that digested their state
    busy: tuple[tuple[int, float], ...] = ()  # (device, seconds it computed) of its trainers


@dataclass(frozen=True)
class NodeEvaluated:
    """Every trainer of ``generation`` on the node took its part of the validation loss before ``step``: their sum."""

    node: int
    generation: int
    step: int
    devices: tuple[int, ...]
    loss_sum: float


@dataclass(frozen=True)
class NodeSaved:
    """Every checkpoint writer of ``generation`` on the node saved its part of the checkpoint at ``step``."""

    node: int
    generation: int
    step: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Positions:
    """An agent's answer to :class:`Probe`: each worker's position and how long its progress counter stood still."""

    node: int
    probe: int
    positions: dict  # {device: (Position, quiet seconds)}


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


# ----- controller → agent ---------------------------------------------------------------------


@dataclass(frozen=True)
class Renew:
    """The controller renews an agent's lease (it had nothing else to say)."""

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
class Noted:
    """The controller recorded a worker's :class:`Dying` of a node fault: its agent may take the node down."""

    generation: int
    device: int


@dataclass(frozen=True)
class Probe:
    """The progress watchdog asks every agent where its workers are (answered by :class:`Positions`)."""

    generation: int
    probe: int


@dataclass(frozen=True)
class Welcome:
    """The controller admits a node: the job's config, where its store is, and the workers to start."""

    node: int
    generation: int
    config: Config
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
    outcome: int | None = None  # the job ended: the ExitCode node 0 exits with, which every agent exits with too


PUSHED = (Moves, Publish, Begin, Commit, Flag, End)
"""What an agent forwards to its workers."""

def _pack_plan(plan: Plan) -> list:
    pipelines = [[p.micro_batches, [[*st.layers, len(st.devices), str(st.recompute)] for st in p.stages]]
                 for p in plan.pipelines]
    return [plan.n_layers, plan.micro_batch_size, pipelines, _runs(plan.devices),
            [[r.pipeline, r.stage, list(r.hosts)] for r in plan.reroutes]]


def _unpack_plan(packed: list) -> Plan:
    n_layers, micro_batch_size, packed_pipelines, runs, reroutes = packed
    devices, at, pipelines = _unruns(runs), 0, []
    for micro, stages in packed_pipelines:
        built = []
        for lo, hi, width, recompute in stages:
            built.append(Stage(devices[at:at + width], (lo, hi), Recompute(recompute)))
            at += width
        pipelines.append(Pipeline(tuple(built), micro))
    if at != len(devices):
        raise ValueError(f"a plan packed with {len(devices)} devices for stages that hold {at}")
    return Plan(n_layers, micro_batch_size, tuple(pipelines), tuple(Reroute(j, s, tuple(hosts)) for j, s, hosts in reroutes))


def _pack_spec(spec: GenerationSpec) -> list:
    return [spec.generation, _pack_plan(spec.plan), _runs(spec.devices), spec.resume_step,
            None if spec.manifest is None else _Packer().pack(spec.manifest), spec.checkpoint, _runs(spec.writers),
            spec.moves, spec.evaluated]


def _unpack_spec(packed: list) -> GenerationSpec:
    generation, plan, devices, resume_step, manifest, checkpoint, writers, moves, evaluated = packed
    return GenerationSpec(generation, _unpack_plan(plan), _unruns(devices), resume_step,
                          None if manifest is None else _unpack_manifest(manifest), checkpoint, _unruns(writers), moves,
                          evaluated)


class _Packer:
    """Packs manifests — a whole one, or each node's part of one — as flat lists of ints (the format is in
    ``docs/protocol.md``): tensor names and regions are indices into tables of their own, each part holding the
    entries it uses; what parts share — a dict of regions many devices hold, the tables — is packed once."""

    def __init__(self):
        self.names: dict[str, int] = {}
        self.regions: dict[tuple, int] = {}
        self.held: dict[int, tuple[dict, list[int]]] = {}  # by id: the dict (kept alive), packed

    def _moves(self, moves: tuple[Move, ...]) -> list[int]:
        names, regions, flat = self.names, self.regions, []
        for m in moves:
            flat += (names.setdefault(m.name, len(names)), regions.setdefault(m.region, len(regions)), m.src, m.dst,
                     m.nbytes)
        return flat

    def _held(self, held: dict) -> list[int]:
        got = self.held.get(id(held))
        if got is None:
            names, regions, flat = self.names, self.regions, []
            for name, region in held.items():
                flat += (names.setdefault(name, len(names)), regions.setdefault(region, len(regions)))
            got = self.held[id(held)] = held, flat
        return got[1]

    def pack(self, m: Manifest) -> list:
        tables: dict[int, int] = {}  # id of a dict of regions → its index in this part's list of them
        held: list[list[int]] = []

        def devices(by_device: dict) -> list[int]:
            out: list[int] = []
            for d, regions in by_device.items():
                if id(regions) not in tables:
                    tables[id(regions)] = len(held)
                    held.append(self._held(regions))
                out += (d, tables[id(regions)])
            return out

        before, after = devices(m.before), devices(m.after)
        local = self._moves(m.local)
        rounds: list = []
        for r, moves in enumerate(m.rounds):
            if moves:
                rounds += (r, self._moves(moves))
        moved = [local, *rounds[1::2]]
        names = {n for flat in moved for n in flat[0::5]}.union(*(flat[0::2] for flat in held))
        regions = {r for flat in moved for r in flat[1::5]}.union(*(flat[1::2] for flat in held))
        name_of, region_of = list(self.names), list(self.regions)
        return [[x for n in sorted(names) for x in (n, name_of[n])],
                [x for r in sorted(regions) for x in (r, len(region_of[r]), *chain.from_iterable(region_of[r]))],
                local, [len(m.rounds), rounds], held, before, after, sorted(m.kept)]


def _unpack_regions(flat: list) -> dict[int, tuple]:
    out, i = {}, 0
    while i < len(flat):
        j = i + 2 + 2 * flat[i + 1]
        out[flat[i]] = tuple(zip(flat[i + 2:j:2], flat[i + 3:j:2]))
        i = j
    return out


def _unpack_manifest(packed: list) -> Manifest:
    names, regions, local, (count, rounds), held, before, after, kept = packed
    names, regions = dict(zip(names[::2], names[1::2])), _unpack_regions(regions)

    def moves(flat: list) -> tuple[Move, ...]:
        return tuple(Move(names[n], regions[r], src, dst, nbytes) for n, r, src, dst, nbytes in zip(*[iter(flat)] * 5))

    tables = [{names[n]: regions[r] for n, r in zip(flat[::2], flat[1::2])} for flat in held]  # shared as they were
    by_round = dict(zip(rounds[::2], rounds[1::2]))
    return Manifest(moves(local), tuple(moves(by_round.get(r, ())) for r in range(count)),
                    {d: tables[i] for d, i in zip(before[::2], before[1::2])},
                    {d: tables[i] for d, i in zip(after[::2], after[1::2])}, frozenset(kept))


@dataclass(frozen=True)
class Parcels:
    """Every node's :class:`Moves` of a generation, with its frame (:func:`parcel`); a node's Moves may be None where
    only its frame is kept (sent back from a planning process: the frame is what goes on the wire)."""

    generation: int
    sends: dict[int, tuple[Moves | None, bytes]]


def parcel(manifest: Manifest, *, generation: int, nodes: Iterable[int], node_of: Callable[[int], int]) -> Parcels:
    """The :class:`Moves` of ``generation`` for each of ``nodes``, its part of ``manifest``, encoded together (off
    the event loop: a re-plan at thousands of devices moves most state): what parts share is packed once, and the
    nodes with no part share one empty one."""
    packing = {Manifest: _Packer().pack}
    parts = manifest_parts(manifest, node_of)
    empty = Moves(generation, Manifest((), tuple(() for _ in manifest.rounds), {}, {}))
    blank = empty, codec.encode(empty, packs=packing)
    sends = {}
    for node in nodes:
        if node in parts:
            moves = Moves(generation, parts[node])
            sends[node] = moves, codec.encode(moves, packs=packing)
        else:
            sends[node] = blank
    return Parcels(generation, sends)


def _flat(pairs) -> list:
    return [x for pair in pairs for x in pair]


def _pairs(flat: list) -> tuple:
    if len(flat) % 2:
        raise ValueError("an odd count of values where pairs were packed")
    return tuple(zip(flat[::2], flat[1::2]))


def _pack_synced(m: Synced) -> list:
    return [m.device, m.generation, m.step, m.loss_sum, _flat(m.samples), m.compute_s, m.norm_sq, m.finite, m.digest,
            m.busy_s]


def _unpack_synced(packed: list) -> Synced:
    device, generation, step, loss_sum, samples, compute_s, norm_sq, finite, digest, busy_s = packed
    return Synced(device, generation, step, loss_sum, _pairs(samples), compute_s, norm_sq, finite, digest, busy_s)


def _pack_node_synced(m: NodeSynced) -> list:
    return [m.node, m.generation, m.step, list(m.devices), m.loss_sum, _flat(m.samples), m.compute_s, m.norm_sq,
            m.t_synced, list(m.corrupt), _flat(m.digests), _flat(m.busy)]


def _unpack_node_synced(packed: list) -> NodeSynced:
    node, generation, step, devices, loss_sum, samples, compute_s, norm_sq, t_synced, corrupt, digests, busy = packed
    return NodeSynced(node, generation, step, tuple(devices), loss_sum, _pairs(samples), compute_s, norm_sq, t_synced,
                      tuple(corrupt), _pairs(digests), _pairs(busy))


codec.register_packed(Plan, pack=_pack_plan, unpack=_unpack_plan)
codec.register_packed(GenerationSpec, pack=_pack_spec, unpack=_unpack_spec)  # to every node: its devices as runs
codec.register_packed(Synced, pack=_pack_synced, unpack=_unpack_synced)  # one a step from every device: packed flat
codec.register_packed(NodeSynced, pack=_pack_node_synced, unpack=_unpack_node_synced)  # and one from every node
codec.register_packed(Manifest, pack=lambda m: _Packer().pack(m), unpack=_unpack_manifest)
codec.register(
    Pipeline, Stage, Reroute, Move, Position, FaultSpec, CommitOrder,
    Moves, Publish, Begin, Commit, Flag, End, Standby, Ready, SelfTimed, Evaluated, CheckpointSaved, Failed, Damaged, Dying,
    FinalShards, Done,    Hello, Lease, NodeReady, NodeEvaluated, NodeSaved, Positions, Exited, Hung,
    Renew, Start, Inject, Noted, Probe, Welcome, Signal, Shutdown,
)
codec.register_tree(Config)
