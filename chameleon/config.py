"""Structured configs (Hydra ConfigStore schemas), config discovery and semantic validation.

The schema types every key; :func:`validate` then checks what types cannot —
that the parallel layout fits the workers, the batch divides into micro-batches,
the model fits in memory — and raises :class:`ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import codecs
import importlib.util
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from chameleon.decision.config import ClusterConfig, PlanQueryConfig, PolicyConfig
from chameleon.faults.spec import FailureConfig, planned_faults
from chameleon.layout.plan import Plan, PlanError, Recompute, even_plan, plan_from_spec
from chameleon.model.config import ModelConfig
from chameleon.schedule import LrSchedule
from chameleon.sim.config import SimConfig, TraceConfig

_PACKAGE_DIR = Path(__file__).resolve().parent


def _resource_dir(name: str) -> Path:
    """``conf``/``recipes`` inside an installed wheel, else beside the source package."""
    installed = _PACKAGE_DIR / name
    return installed if installed.is_dir() else _PACKAGE_DIR.parent / name


CONF_DIR = _resource_dir("conf")
RECIPES_DIR = _resource_dir("recipes")


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


class Dtype(StrEnum):
    """``train.dtype``: fp32, or bf16 compute over fp32 master weights, gradients and AdamW moments."""

    fp32 = "fp32"
    bf16 = "bf16"


class Backend(StrEnum):
    """``launcher.backend``: the collective library of the workers' process groups."""

    gloo = "gloo"
    nccl = "nccl"
    hccl = "hccl"


class Device(StrEnum):
    """``launcher.device``: what a worker computes on."""

    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"

    @property
    def backend(self) -> Backend:
        """The backend this device's workers use unless ``launcher.backend`` says otherwise."""
        return {Device.cpu: Backend.gloo, Device.cuda: Backend.nccl, Device.npu: Backend.hccl}[self]


class OnFault(StrEnum):
    """``ft.on_fault``: survive faults in place, or stop every worker for an outer relaunch (exit 3)."""

    recover = "recover"
    exit = "exit"


class OnCorrupt(StrEnum):
    """``ft.on_corrupt``: what becomes of a device whose own gradients were not finite in a step whose replay was:
    kept (the fault was transient), or evicted and recovered as a lost device."""

    replay = "replay"
    evict = "evict"


class SlowPolicy(StrEnum):
    """``ft.slow``: find fail-slow devices and decide by Eq. 8 how to train around them, or not (tolerate them)."""

    on = "on"
    off = "off"


@dataclass
class TrainConfig:
    steps: int = 100
    global_batch: int = 16
    micro_batch: int = 4
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    seed: int = 0
    dtype: Dtype = Dtype.fp32  # fp32 | bf16 (bf16 compute; fp32 master weights, gradients and AdamW moments)
    # Activation recomputation: none | selective (the attention core, in backward) | full (each layer from its input)
    recompute: Recompute = Recompute.none
    clip_norm: float = 1.0  # clip the global gradient norm (over the whole plan) to this; 0 disables
    compile: bool = False  # torch.compile each stage's forward (compiled once per worker, kept across steps)
    bucket_mb: float = 25.0  # the gradient sync's buckets (each launched as its gradients are final) hold at most this
    lr_schedule: LrSchedule = LrSchedule.cosine  # constant | cosine (by global step, after the linear warm-up)
    warmup_steps: int = 10
    min_lr: float = 3e-4  # where the cosine schedule ends
    # Validation loss every eval_interval steps and after the last (0: never), over eval_batches global batches.
    eval_interval: int = 25
    eval_batches: int = 2


class Pack(StrEnum):
    """``data.pack``: windows over the concatenated documents, or windows none of which straddles two."""

    window = "window"
    document = "document"


@dataclass
class DataConfig:
    # What training reads: a folder of token shards (python -m chameleon.prepare), a UTF-8 text file
    # (byte-level tokens), or None for the bundled corpus.
    path: str | None = None
    # python -m chameleon.prepare: the source (a .txt/.jsonl/.json/.parquet file or a folder of them) and
    # the tokenizer (bytes | bpe:N | a tokenizer.json or model folder | a SentencePiece or tiktoken model).
    source: str | None = None
    tokenizer: str = "bytes"
    text_key: str = "text"  # the JSONL/Parquet field holding each document's text
    eos_token: str | None = None  # the end-of-document token, when the tokenizer does not name one
    workers: int = 1  # tokenizing processes
    # Validation: documents held out of training (a seeded choice holding this fraction of the tokens), or
    # shards of their own.
    val_fraction: float = 0.05
    val_path: str | None = None
    # window: windows of seq_len+1 tokens over the concatenated documents; document: none straddles two.
    pack: Pack = Pack.window


@dataclass
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    # Explicit (possibly uneven) pipelines, overriding dp/pp:
    # [{layers: [[0, 3], [3, 6], [6, 8]], micro_batches: 3}, {layers: [2, 2, 2, 2], micro_batches: 1}]
    pipelines: list[Any] | None = None


@dataclass
class LauncherConfig:
    # Nodes and where they meet (null: from SLURM_NNODES, NODE_RANK/SLURM_NODEID, MASTER_ADDR, MASTER_PORT,
    # else one node on 127.0.0.1 with a free port); chameleon/runtime/node/launch.py resolves them.
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None  # the c10d store; 0 picks a free port (one node only)
    control_port: int | None = None  # where node agents reach the controller; null: master_port + 1
    node_addr: str | None = None  # this node's address for process groups; null: the route to master_addr
    join_timeout_s: float = 120.0  # how long the controller waits for nodes, and an agent for the controller
    nproc_per_node: int = 1  # workers (devices) per node; the world is nnodes · nproc_per_node
    device: Device = Device.cpu  # cpu (gloo) | cuda (nccl) | npu (hccl)
    timeout_s: float = 60.0  # backend and store timeouts; a worker's bound on silence from the controller
    threads_per_worker: int = 1
    memory_per_device_gb: float | None = None  # None: this host's RAM (cpu) or the device's memory
    backend: Backend | None = None  # None: by device (gloo, nccl, hccl); gloo also drives cuda (e.g. workers sharing one GPU)


@dataclass
class FaultToleranceConfig:
    # A worker whose heartbeat stops this long is hung and fenced (SIGKILL); a node whose agent misses
    # its lease this long is lost (the agent fences its own workers after twice as long).
    heartbeat_timeout_s: float = 2.0
    # Progress watchdog: when no step commits for stall_timeout_s (null: max(stall_min_s, stall_factor ×
    # the expected step time)), devices stuck on their own are fenced; if none is, the run stops naming them.
    stall_timeout_s: float | None = None
    stall_min_s: float = 10.0
    stall_factor: float = 20.0
    # Aborting a broken generation's communicators (NCCL/HCCL) may take this long; a worker whose abort
    # has not returned by then fences itself and is replaced as a lost device.
    abort_timeout_s: float = 10.0
    # The likely next faults, planned ahead so that they are decided with no search: a device, and 1 up to this
    # many whole nodes at once (a rack, a switch: the nodes that fail together).
    fault_domain_nodes: int = 4
    # recover: survive faults in place. exit: like torchrun, stop every worker and exit 3 so an outer
    # scheduler relaunches the job (with ckpt.resume) — the restart path Chameleon is measured against.
    on_fault: OnFault = OnFault.recover
    # A step whose gradient norm or loss is not finite is never committed: it is replayed (its samples are a pure
    # function of their ids). A finite replay means the fault was transient; the device whose own gradients were
    # not finite is named, and kept (replay) or evicted as a lost device (evict). A replay not finite again stops
    # the run, naming the step and its samples (the data or the model diverged).
    on_corrupt: OnCorrupt = OnCorrupt.replay
    # Replica agreement: every step each trainer digests a 1/digest_interval slice of its state (parameters and
    # moments, as used by that step), so each tensor is digested once every digest_interval steps; replicas of a
    # region that disagree keep the step from committing, and the holders outvoted (all of them, with no majority:
    # the newest checkpoint arbitrates) are lost devices. 0: off.
    digest_interval: int = 10
    # Fail-slow devices (ft.slow=on): a device whose own compute runs slow_ratio × its peers' pace (per unit of work,
    # among those holding the same layers) for slow_window steps in a row is slow; the controller decides by Eq. 8,
    # over the slowness's expected remaining slow_expected_s, whether to tolerate it, rebalance micro-batches,
    # re-plan or evict it (idle); back to speed for slow_window steps, the job grows back onto it. off: tolerate.
    slow: SlowPolicy = SlowPolicy.on
    slow_ratio: float = 1.5
    slow_window: int = 4
    slow_expected_s: float = 600.0


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N committed steps; 0 disables checkpoints
    dir: str | None = None  # None: <run dir>/checkpoints
    keep: int = 2
    resume: str | None = None  # a checkpoint root: start from its newest complete checkpoint


@dataclass
class OutputConfig:
    progress: bool = True  # a progress bar on stderr, when it is a terminal
    save_params: bool = True  # final_params.pt in the run dir
    export_hf: bool = False  # also hf/ in the run dir: the trained weights as a Hugging Face Llama checkpoint


@dataclass
class ReportConfig:
    plots: bool = True  # run.png in the run dir: loss and throughput, each fault and its recovery marked
    tensorboard: bool = False  # live scalars in <run dir>/tensorboard (pip install 'chameleon[tensorboard]')
    wandb: bool = False  # live scalars to Weights & Biases, offline without WANDB_API_KEY (pip install 'chameleon[wandb]')


@dataclass
class Config:
    model: ModelConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    plan: PlanQueryConfig = field(default_factory=PlanQueryConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)


def register_configs() -> None:
    """Register the schema, every ``recipes/*.yaml`` (as group ``recipe``) and the ``world_size`` resolver."""
    OmegaConf.register_new_resolver("world_size", lambda nnodes, per_node: (nnodes or 1) * per_node, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def to_container(cfg: DictConfig) -> dict:
    """A plain, resolved dict of the config."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def to_config(cfg: DictConfig) -> Config:
    """The typed :class:`Config` of a composed config, resolved (what the runtime receives)."""
    body = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), body))


def world_size(launcher) -> int:
    """Devices of the whole job: ``launcher.nnodes · launcher.nproc_per_node`` (one node when unresolved)."""
    return (launcher.nnodes or 1) * launcher.nproc_per_node


def _world_text(launcher) -> str:
    if launcher.nnodes == 1:
        return f"launcher.nproc_per_node={launcher.nproc_per_node}"
    return f"launcher.nnodes·nproc_per_node = {launcher.nnodes}·{launcher.nproc_per_node} = {world_size(launcher)}"


def _world_fix(launcher, devices: int) -> str:
    if launcher.nnodes == 1 or devices % launcher.nnodes:
        return f"launcher.nproc_per_node={devices}" + (" launcher.nnodes=1" if launcher.nnodes > 1 else "")
    return f"launcher.nproc_per_node={devices // launcher.nnodes}"


def model_config(cfg: DictConfig | dict) -> ModelConfig:
    """The typed :class:`ModelConfig` of a composed config."""
    model = cfg["model"]
    if isinstance(model, DictConfig):
        model = OmegaConf.to_container(model, resolve=True)
    return ModelConfig(**model)


def build_plan(cfg: DictConfig | dict) -> Plan:
    """The failure-free plan of a config, from ``parallel.pipelines`` or ``parallel.dp/pp/tp``, every stage under
    ``train.recompute``."""
    par, train = cfg["parallel"], cfg["train"]
    n_layers = cfg["model"]["n_layers"]
    recompute = Recompute(train["recompute"])
    try:
        if par["pipelines"]:
            return plan_from_spec(
                list(_plain(par["pipelines"])), tp=par["tp"], n_layers=n_layers,
                global_batch=train["global_batch"], micro_batch=train["micro_batch"], recompute=recompute,
            )
        return even_plan(
            dp=par["dp"], pp=par["pp"], tp=par["tp"], n_layers=n_layers,
            global_batch=train["global_batch"], micro_batch=train["micro_batch"], recompute=recompute,
        )
    except PlanError as err:
        raise ConfigError(str(err)) from None


def typed(cfg: DictConfig, key: str, schema: type):
    """``cfg[key]`` merged over ``schema``'s defaults, as the dataclass."""
    node = cfg.get(key)
    merged = OmegaConf.merge(OmegaConf.structured(schema), node if node is not None else {})
    return OmegaConf.to_object(merged)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def validate(cfg: DictConfig) -> Plan:
    """Check the config's semantics (its launch keys resolved); return its plan. What the host offers (memory,
    devices, data files, a checkpoint) is checked by :func:`chameleon.runtime.node.preflight.check_job`.

    Raises:
        ConfigError: naming the offending key and the fix.
    """
    model, train, par, launcher = cfg.model, cfg.train, cfg.parallel, cfg.launcher
    check(launcher.nnodes >= 1, f"launcher.nnodes={launcher.nnodes}: need at least one node")
    check(launcher.timeout_s > 0 and launcher.join_timeout_s > 0,
           f"launcher.timeout_s={launcher.timeout_s} / launcher.join_timeout_s={launcher.join_timeout_s}: must be > 0")
    check(launcher.nproc_per_node >= 1, f"launcher.nproc_per_node={launcher.nproc_per_node}: need at least one worker")
    n_devices = world_size(launcher)
    check(train.steps >= 1, f"train.steps={train.steps}: must be ≥ 1")
    check_batch(train)
    check(train.lr > 0, f"train.lr={train.lr}: must be > 0")
    check(train.bucket_mb > 0, f"train.bucket_mb={train.bucket_mb}: must be > 0 (MB per gradient bucket)")
    _check_arch(model_config(cfg))
    _check_training_keys(cfg)
    for key in ("dp", "pp", "tp"):
        check(par[key] >= 1, f"parallel.{key}={par[key]}: must be ≥ 1")
    check(model.dim % model.n_heads == 0, f"model.dim={model.dim} is not divisible by model.n_heads={model.n_heads}")
    check(
        model.n_heads % model.n_kv_heads == 0,
        f"model.n_heads={model.n_heads} is not a multiple of model.n_kv_heads={model.n_kv_heads}",
    )
    check(train.seq_len <= model.max_seq_len, f"train.seq_len={train.seq_len} exceeds model.max_seq_len={model.max_seq_len}")
    check(
        model.n_kv_heads % par.tp == 0,
        f"parallel.tp={par.tp} does not divide model.n_kv_heads={model.n_kv_heads}: pick a tp that divides it",
    )
    if not par.pipelines:
        world = par.dp * par.pp * par.tp
        check(
            world == n_devices,
            f"parallel.dp·pp·tp = {par.dp}·{par.pp}·{par.tp} = {world} but {_world_text(launcher)}: "
            f"set {_world_fix(launcher, world)} or change the layout (parallel=dp for plain data parallelism)",
        )
        check(par.pp <= model.n_layers, f"parallel.pp={par.pp} exceeds model.n_layers={model.n_layers}: use at most one stage per layer")
    plan = build_plan(cfg)
    for j, pipe in enumerate(plan.pipelines):
        width = pipe.stages[0].tp
        check(model.n_kv_heads % width == 0 and model.n_heads % width == 0,
              f"parallel.pipelines[{j}].tp={width} does not divide model.n_heads={model.n_heads} and "
              f"model.n_kv_heads={model.n_kv_heads}: pick a tp that divides both")
    check(
        len(plan.devices) == n_devices,
        f"parallel.pipelines use {len(plan.devices)} devices but {_world_text(launcher)}: "
        f"set {_world_fix(launcher, len(plan.devices))}",
    )
    try:
        planned_faults(cfg.failure, world=n_devices, nnodes=launcher.nnodes)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    ft = cfg.ft
    for key in ("heartbeat_timeout_s", "stall_min_s", "stall_factor", "abort_timeout_s"):
        check(ft[key] > 0, f"ft.{key}={ft[key]}: must be > 0")
    budget = cfg.policy.decide_budget_s
    check(budget is None or budget > 0, f"policy.decide_budget_s={budget}: null (unbounded) or > 0 seconds")
    check(ft.digest_interval >= 0, f"ft.digest_interval={ft.digest_interval}: use 0 (off) or a positive step count")
    check(ft.slow_ratio > 1, f"ft.slow_ratio={ft.slow_ratio}: a device is slow at a pace above its peers': use > 1")
    check(ft.slow_window >= 1, f"ft.slow_window={ft.slow_window}: judge over at least 1 step")
    check(ft.slow_expected_s > 0, f"ft.slow_expected_s={ft.slow_expected_s}: use > 0 seconds")
    check(ft.fault_domain_nodes >= 1, f"ft.fault_domain_nodes={ft.fault_domain_nodes}: plan ahead for at least one node")
    check(ft.stall_timeout_s is None or ft.stall_timeout_s > 0, f"ft.stall_timeout_s={ft.stall_timeout_s}: null or > 0")
    check(cfg.ckpt.interval >= 0, f"ckpt.interval={cfg.ckpt.interval}: use 0 (off) or a positive step count")
    check(cfg.ckpt.keep >= 1, f"ckpt.keep={cfg.ckpt.keep}: keep at least 1 checkpoint")
    return plan


def check_data(cfg: DictConfig) -> None:
    """Refuse data that cannot be read, does not fit the model, or leaves no training or validation window."""
    from chameleon.data.stream import open_streams

    data, train = cfg.data, cfg.train
    check(0 <= data.val_fraction < 1, f"data.val_fraction={data.val_fraction}: use a fraction in [0, 1)")
    check(train.eval_interval >= 0 and train.eval_batches >= 1,
           f"train.eval_interval={train.eval_interval} / train.eval_batches={train.eval_batches}: "
           "use an interval ≥ 0 (0: no validation) and at least one batch")
    for key in ("path", "val_path"):
        if data[key] is not None:
            _check_source(f"data.{key}", data[key])
    try:
        streams = open_streams(data, seq_len=train.seq_len, seed=train.seed)
    except ValueError as err:  # shards.DataError among them
        raise ConfigError(f"data.path={data.path!r}: {err}") from None
    check(streams.vocab_size <= cfg.model.vocab_size,
           f"data.path={data.path} holds token ids of a {streams.vocab_size}-token vocabulary but "
           f"model.vocab_size={cfg.model.vocab_size}: set model.vocab_size={streams.vocab_size} (or more)")
    if train.eval_interval == 0:
        return
    evaluated = train.eval_batches * train.global_batch
    check(streams.val is not None,
           f"train.eval_interval={train.eval_interval} needs validation documents, but data.val_fraction="
           f"{data.val_fraction} of {streams.n_documents} document(s) holds none out: give data.val_path=, "
           "a corpus of several documents, or set train.eval_interval=0")
    check(streams.val.n_windows >= evaluated,
           f"train.eval_batches={train.eval_batches} evaluates {evaluated} windows but the validation documents "
           f"hold {streams.val.n_windows}: lower train.eval_batches, raise data.val_fraction, or give data.val_path=")


def _check_source(key: str, path: str) -> None:
    """A folder of prepared shards (checked against its manifest), or a UTF-8 text file."""
    from chameleon.data.shards import DataError, check_shards

    file = Path(path).expanduser()
    if file.is_dir():
        try:
            check_shards(file)
        except DataError as err:
            raise ConfigError(f"{key}={path}: {err}") from None
        return
    fix = "give a folder of token shards (python -m chameleon.prepare), a UTF-8 text file, or data.path=null"
    check(file.is_file(), f"{key}={path!r} is not a file: {fix}")
    try:
        with file.open("rb") as f:
            head = f.read(1 << 20)
    except OSError as err:
        raise ConfigError(f"{key}={path!r} cannot be read ({err.strerror}): {fix}") from None
    check(b"\0" not in head, f"{key}={path!r} looks binary (it holds NUL bytes): {fix}")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{key}={path!r} is not UTF-8 text (byte {err.start} of the file): {fix}") from None


def _check_arch(model: ModelConfig) -> None:
    """Refuse a ``model.arch`` that names no architecture."""
    from chameleon.model.spec import spec_of

    try:
        spec_of(model)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_training_keys(cfg: DictConfig) -> None:
    """Precision, clipping, schedule, initial weights, export and report keys."""
    from chameleon.model.hf import HFCheckpointError, check_hf, hf_checkpoint, require_llama

    train = cfg.train
    check(train.clip_norm >= 0, f"train.clip_norm={train.clip_norm}: use 0 (off) or a positive norm")
    check(train.warmup_steps >= 0, f"train.warmup_steps={train.warmup_steps}: must be ≥ 0")
    check(0 <= train.min_lr <= train.lr, f"train.min_lr={train.min_lr}: must be in [0, train.lr={train.lr}]")
    check(not cfg.output.export_hf or cfg.output.save_params,
           "output.export_hf=true needs the trained parameters: set output.save_params=true")
    check(not cfg.report.tensorboard or importlib.util.find_spec("tensorboard") is not None,
           "report.tensorboard=true needs the tensorboard package: pip install 'chameleon[tensorboard]'")
    check(not cfg.report.wandb or importlib.util.find_spec("wandb") is not None,
           "report.wandb=true needs the wandb package: pip install 'chameleon[wandb]'")
    try:
        if cfg.output.export_hf:
            require_llama(model_config(cfg), "output.export_hf")
        source = hf_checkpoint(cfg.model.init)
        if source is not None:
            check_hf(source, model_config(cfg))
    except HFCheckpointError as err:
        raise ConfigError(str(err)) from None


def tags_honoured(launcher) -> bool:
    """True when the workers' backend matches point-to-point messages by tag and buffers sends (gloo). NCCL and HCCL
    do neither: a plan with reroutes runs there only if :func:`~chameleon.layout.rendezvous.rendezvous_fault` finds
    its traffic safe (a plan without reroutes, as every launch plan, always is: docs/accelerators.md)."""
    return launcher.device == Device.cpu or launcher.backend == Backend.gloo


def check_batch(train) -> None:
    """The batch every entry point plans with: ``train.global_batch``, ``micro_batch`` and ``seq_len`` each ≥ 1.

    Raises:
        ConfigError: naming the key.
    """
    for key in ("global_batch", "micro_batch", "seq_len"):
        check(train[key] >= 1, f"train.{key}={train[key]}: must be ≥ 1")


def check(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)
