"""Profiles: what one stage of the model costs on one device, measured or derived.

A :class:`Profile` is the estimator's only input about hardware. ``kind=local``
measures this machine for real — per-layer forward/backward time of the model
spec's ``stage_forward`` (:mod:`chameleon.model.spec`) under each recomputation, the embedding and head extras,
the bytes a forward keeps for its backward, an AdamW step (:func:`chameleon.optim.adamw`), gloo
point-to-point, all-reduce and group-creation costs with a few real processes, and a real
tensor-parallel layer across ``tp`` gloo processes for each TP size this host can give a core
per process — and caches the result as JSON.
``kind=analytic`` derives the same fields from datasheet figures and the spec's
FLOPs (about 6·params·tokens, fwd:bwd = 1:2) for hardware we cannot run.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import cached_property, partial
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from chameleon.decision.config import ClusterConfig
from chameleon.layout.geometry import ELEMENT_BYTES, StateBytes, UnitParams, state_bytes
from chameleon.layout.memory import DeviceOverheads, LayerActivations, MemoryCosts
from chameleon.layout.plan import Recompute
from chameleon.layout.spec import placements_for, shard_region
from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of
from chameleon.optim import adamw, init_moments


class TPTerms(NamedTuple):
    """Seconds a layer's forward and backward take per micro-batch at TP size ``tp`` beyond its compute ÷ ``tp``
    (its all-reduces, their hand-off to a waiter thread, their contention with compute), and the part of each
    its process spends waiting with no thread on a core."""

    tp: int
    fwd_s: float
    bwd_s: float
    fwd_idle_s: float = 0.0
    bwd_idle_s: float = 0.0


class RecomputeTerms(NamedTuple):
    """One layer per micro-batch under recomputation ``recompute``: the share of its forward its backward reruns
    (0 without recomputation), the bytes its forward keeps for the backward and those its backward rebuilds at once
    (at the profile's TP size)."""

    recompute: str
    rerun: float
    act_bytes: int
    rebuilt_bytes: int


@dataclass(frozen=True)
class Profile:
    """Costs of one stage unit (a TP group of ``tp`` devices) per micro-batch.

    Times are seconds per micro-batch; ``*_params`` are whole (unsharded) element
    counts; activation bytes are what autograd keeps per micro-batch until backward.
    ``dtype`` is the compute dtype: every byte count of the training state follows
    from it (:attr:`state`). Bandwidths are bytes/s. ``host_cores`` is set for CPU
    devices (worker processes), which time-share their node's cores with each other
    and with ``background_procs`` busy processes of other jobs. Compute times are CPU
    times: what an op costs on a core of its own. ``tp_terms`` prices a stage of any TP size
    (:meth:`layer_s`, :class:`TPTerms`); a size not listed adds nothing (an analytic profile's layers). The
    layer terms are those of ``recompute`` (the job's ``train.recompute``); ``recompute_terms`` those of every
    recomputation, which price a stage under its own (:meth:`under`).
    """

    key: str
    source: str
    n_layers: int
    micro_batch: int
    seq_len: int
    tp: int
    layer_fwd_s: float
    layer_bwd_s: float
    first_fwd_s: float
    first_bwd_s: float
    last_fwd_s: float
    last_bwd_s: float
    layer_params: int
    first_params: int
    last_params: int
    dtype: str
    layer_act_bytes: int
    first_act_bytes: int
    last_act_bytes: int
    boundary_bytes: int
    memory_bytes: float
    p2p_bw: float
    p2p_latency_s: float
    dp_bw: float
    dp_latency_s: float
    group_create_s: float
    optimizer_s_per_param: float
    checkpoint_bw: float
    restart_s: float
    n_devices: int
    devices_per_node: int
    host_cores: float = 0.0  # CPU cores the devices of one node share; 0: each device computes on its own
    # CPU-bound processes of other jobs on the node: a transient, never cached; the profile keeps 0 and a
    # caller that measured it now (measure_background) sets it for its own estimates.
    background_procs: float = 0.0
    commit_s: float = 0.0  # a step's commit round trip: a report up to the controller and its answer down (see profile_comm)
    shadow_bytes_per_param: float = 0.0  # another stage's state also kept per parameter (a simulated Bamboo's shadow)
    recompute: str = "none"  # train.recompute the layer costs were taken under (backward times include it)
    layer_rebuilt_bytes: int = 0  # what a layer's backward rebuilds at once under recompute (one micro-batch)
    tp_terms: tuple[TPTerms, ...] = ()  # what a layer adds at each TP size (measured profiles)
    recompute_terms: tuple[RecomputeTerms, ...] = ()  # a layer under each recomputation (none: only its own priced)
    head_work_bytes: int = 0  # what the loss makes for a while on the last stage (ModelSpec.head_work)
    overheads: DeviceOverheads = DeviceOverheads()  # what a device holds besides the plan's tensors (the cluster's)

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        """The profile :meth:`to_dict` wrote (JSON lists made :class:`TPTerms` and :class:`RecomputeTerms` again)."""
        return cls(**{**data, "tp_terms": tuple(TPTerms(*terms) for terms in data.get("tp_terms", ())),
                      "recompute_terms": tuple(RecomputeTerms(*terms) for terms in data.get("recompute_terms", ())),
                      "overheads": DeviceOverheads(**data.get("overheads", {}))})

    @property
    def leaner(self) -> tuple[str, ...]:
        """The recomputations this profile prices from the job's on, each keeping less than the one before: what a
        stage over memory may run under."""
        priced = {terms.recompute for terms in self.recompute_terms} | {self.recompute}
        order = list(Recompute)
        return tuple(mode for mode in order[order.index(self.recompute):] if mode in priced)

    def under(self, recompute: str) -> Profile:
        """This profile with its layers under ``recompute``: its backward reruns that share of its forward (at every
        TP size, the forward's TP terms included), and its activations are that recomputation's (as it is where
        ``recompute_terms`` lists none)."""
        return self._under.get(recompute, self)

    @cached_property
    def _under(self) -> dict[str, Profile]:
        """:meth:`under` for each recomputation listed."""
        own = {terms.recompute: terms.rerun for terms in self.recompute_terms}.get(self.recompute, 0.0)
        return {
            terms.recompute: replace(
                self, recompute=terms.recompute, layer_bwd_s=self.layer_bwd_s + (terms.rerun - own) * self.layer_fwd_s,
                layer_act_bytes=terms.act_bytes, layer_rebuilt_bytes=terms.rebuilt_bytes,
                tp_terms=tuple(t._replace(bwd_s=t.bwd_s + (terms.rerun - own) * t.fwd_s) for t in self.tp_terms),
            ) if terms.recompute != self.recompute else self
            for terms in self.recompute_terms
        }

    def tp_extra(self, tp: int) -> TPTerms:
        """The TP terms of size ``tp`` (not listed: nothing)."""
        return next((terms for terms in self.tp_terms if terms.tp == tp), TPTerms(tp, 0.0, 0.0))

    def layer_s(self, tp: int = 0) -> tuple[float, float]:
        """Forward and backward seconds of one layer per micro-batch on a stage of TP size ``tp`` (0: the
        profile's): the profile's layer compute split ``tp`` ways plus that size's TP terms."""
        own, extra = self.tp_extra(self.tp), self.tp_extra(tp or self.tp)
        scale = self.tp / (tp or self.tp)
        return (self.layer_fwd_s - own.fwd_s) * scale + extra.fwd_s, (self.layer_bwd_s - own.bwd_s) * scale + extra.bwd_s

    @property
    def state(self) -> StateBytes:
        """Bytes per parameter of each part of the training state (:func:`chameleon.layout.geometry.state_bytes`)."""
        return state_bytes(self.dtype)

    @property
    def units(self) -> UnitParams:
        """Whole element counts of a layer, the embedding and the head."""
        return UnitParams(self.layer_params, self.first_params, self.last_params)

    @property
    def memory_costs(self) -> MemoryCosts:
        """This profile's stage parts for :func:`chameleon.layout.memory.plan_memory` (layer activations made whole,
        under each recomputation it prices)."""
        acts = UnitParams(self.layer_act_bytes * self.tp, self.first_act_bytes, self.last_act_bytes)
        layers_under = tuple(LayerActivations(t.recompute, t.act_bytes * self.tp, t.rebuilt_bytes * self.tp)
                             for t in self.recompute_terms)
        return MemoryCosts(self.units, acts, self.state.resident + self.shadow_bytes_per_param,
                           layer_rebuilt=self.layer_rebuilt_bytes * self.tp, layers_under=layers_under,
                           head_work=self.head_work_bytes, overheads=self.overheads)

    def to_dict(self) -> dict:
        return asdict(self)


PROFILE_FORMAT = 8  # bumped whenever what a profile measures changes, so older cached profiles are measured anew


def profile_key(model: ModelConfig, *, micro_batch: int, seq_len: int, tp: int, device: str, recompute: str = "none") -> str:
    """The cache key: the profile format, architecture and shape, micro-batch, sequence length, recomputation,
    device and torch version."""
    shape = (
        f"{model.arch}-d{model.dim}-L{model.n_layers}-h{model.n_heads}-kv{model.n_kv_heads}-v{model.vocab_size}"
        f"-f{model.ffn_hidden_dim}"
    )
    recomputed = "" if recompute == "none" else f"_rc{recompute}"
    return f"v{PROFILE_FORMAT}_{shape}_mb{micro_batch}_s{seq_len}{recomputed}_tp{tp}_{device}_torch{torch.__version__}"


def load_profile(
    model: ModelConfig, cluster: ClusterConfig, *, micro_batch: int, seq_len: int, tp: int = 1, threads: int = 1,
    recompute: str = "none",
) -> Profile:
    """The profile for ``cluster``: analytic, or measured here and cached by :func:`profile_key`.

    ``threads`` is the torch thread count of one worker (``launcher.threads_per_worker``);
    a local measurement runs with it, as the workers will. ``recompute`` is ``train.recompute``.
    """
    if cluster.kind == "analytic":
        return analytic_profile(model, cluster, micro_batch=micro_batch, seq_len=seq_len, tp=tp, recompute=recompute)
    if cluster.kind != "local":
        raise ValueError(f"cluster.kind={cluster.kind!r}: use local or analytic")
    key = profile_key(model, micro_batch=micro_batch, seq_len=seq_len, tp=1, device=f"cpu{threads}t-{cluster.name}",
                      recompute=recompute)
    path = Path(os.path.expanduser(cluster.cache_dir)) / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    if data.get("key") == key:
        profile = replace(Profile.from_dict(data), **_configured(cluster))  # the cluster's figures as given now
    else:
        profile = measure_profile(model, cluster, micro_batch=micro_batch, seq_len=seq_len, key=key, threads=threads,
                                  recompute=recompute)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile.to_dict(), indent=1))
    return with_tensor_parallel(profile, tp) if tp > 1 else profile


def with_tensor_parallel(profile: Profile, tp: int) -> Profile:
    """A measured single-device profile turned into one of ``tp``-device stages (Megatron layout).

    A transformer layer's compute splits ``tp`` ways and adds the profile's TP terms of that
    size (:meth:`Profile.layer_s`); its activations split too. The embedding and output head
    are replicated, so their costs stay whole.
    """
    fwd, bwd = profile.layer_s(tp)
    return replace(
        profile,
        key=f"{profile.key}_tp{tp}",
        tp=tp,
        layer_fwd_s=fwd,
        layer_bwd_s=bwd,
        layer_act_bytes=profile.layer_act_bytes // tp,
        layer_rebuilt_bytes=profile.layer_rebuilt_bytes // tp,
        recompute_terms=tuple(t._replace(act_bytes=t.act_bytes // tp, rebuilt_bytes=t.rebuilt_bytes // tp)
                              for t in profile.recompute_terms),
    )


def ring_all_reduce_s(latency_s: float, bandwidth: float, nbytes: float, group_size: int) -> float:
    """A ring all-reduce of ``nbytes`` over ``group_size`` devices: ``α + 2(n−1)/n · bytes / bus bandwidth``."""
    if group_size < 2:
        return 0.0
    return latency_s + 2 * (group_size - 1) / group_size * nbytes / bandwidth


def count_tp_all_reduces(model: ModelConfig, params: dict[str, Tensor], x: Tensor, *, recompute: str) -> tuple[int, int]:
    """All-reduces a Megatron layer runs per micro-batch, forward and backward, counted on the spec's own layer
    (``params``, whole or a shard) under ``recompute``, whose backward reruns part of the forward."""
    calls: list[Tensor] = []
    ops = spec_of(model).tp_ops(calls.append)
    out = spec_of(model).stage_forward(params, model, x, layers=(0, 1), first=False, last=False, tp=ops,
                                       recompute=recompute)
    forward = len(calls)
    out.backward(torch.ones_like(out))
    return forward, len(calls) - forward


def tp_terms(sizes: Iterable[int], measured: dict[int, TPTerms], all_reduce: Callable[[int], float],
             counts: tuple[int, int]) -> tuple[TPTerms, ...]:
    """The TP terms of every size in ``sizes``: ``measured`` where it was, else those of the largest smaller
    measured size (none below: size 1, which adds nothing) plus the growth of ``counts`` (forward, backward)
    all-reduces from that size to this one as ``all_reduce(size)`` prices one (0 at size 1), spent waiting."""
    out = []
    for t in sorted(set(sizes) - {1}):
        if t in measured:
            out.append(measured[t])
            continue
        base = max((m for m in measured if m < t), default=1)
        terms = measured.get(base, TPTerms(base, 0.0, 0.0))
        fwd, bwd = (n * (all_reduce(t) - all_reduce(base)) for n in counts)
        out.append(TPTerms(t, terms.fwd_s + fwd, terms.bwd_s + bwd, terms.fwd_idle_s + fwd, terms.bwd_idle_s + bwd))
    return tuple(out)


def analytic_profile(model: ModelConfig, cluster: ClusterConfig, *, micro_batch: int, seq_len: int, tp: int,
                     recompute: str = "none") -> Profile:
    """A profile from datasheet figures.

    Forward FLOPs per token come from the model spec (a dense decoder such as Llama:
    ``2·P + 2·s·dim`` a layer), backward twice that, at the peak of ``cluster.dtype``.
    Activations assume a fused attention kernel (no ``s×s`` scores kept) in that dtype; the
    head keeps fp32 logits. The optimizer step streams the weight, gradient and
    moments in and the weight, moments and compute copy out. Under ``recompute`` a layer keeps
    less; under ``full`` its backward reruns its forward (``selective`` reruns no matmul, only
    element-wise ops, which count no FLOPs here: a measured profile times them). ``recompute_terms`` price
    every recomputation the same way.
    """
    spec = spec_of(model)
    layer_p, first_p, last_p = spec.unit_params(model)
    tokens = micro_batch * seq_len
    rate = cluster.peak_tflops * 1e12 * cluster.mfu * tp
    layer_fwd, first_fwd, head_fwd = (flops * tokens / rate for flops in spec.forward_flops(model, seq_len, layer_p))
    n_nodes = -(-cluster.n_devices // cluster.devices_per_node)
    dp_gbps = cluster.inter_gbps if n_nodes > 1 else cluster.intra_gbps
    if cluster.memory_gb is None:
        raise ValueError(f"cluster.memory_gb is required for an analytic cluster ({cluster.name})")
    if cluster.dtype not in ELEMENT_BYTES:
        raise ValueError(f"cluster.dtype={cluster.dtype!r}: use one of {sorted(ELEMENT_BYTES)}")
    elem, state = ELEMENT_BYTES[cluster.dtype], state_bytes(cluster.dtype)
    terms = {mode: RecomputeTerms(mode, 1.0 if mode == Recompute.full else 0.0,
                                  *(n * elem // tp for n in spec.layer_activations(model, micro_batch=micro_batch,
                                                                                  seq_len=seq_len, recompute=mode)))
             for mode in Recompute}
    own = terms[recompute]
    return Profile(
        key=profile_key(model, micro_batch=micro_batch, seq_len=seq_len, tp=tp, device=cluster.name, recompute=recompute),
        source=f"analytic {cluster.name}: {cluster.peak_tflops} TFLOP/s × {cluster.mfu}",
        n_layers=model.n_layers,
        micro_batch=micro_batch,
        seq_len=seq_len,
        tp=tp,
        layer_fwd_s=layer_fwd,
        layer_bwd_s=(2 + own.rerun) * layer_fwd,
        first_fwd_s=first_fwd,
        first_bwd_s=2 * first_fwd,
        last_fwd_s=head_fwd,
        last_bwd_s=2 * head_fwd,
        layer_params=layer_p,
        first_params=first_p,
        last_params=last_p,
        dtype=cluster.dtype,
        layer_act_bytes=own.act_bytes,
        layer_rebuilt_bytes=own.rebuilt_bytes,
        recompute=recompute,
        recompute_terms=tuple(terms.values()),
        first_act_bytes=0,
        last_act_bytes=tokens * model.vocab_size * ELEMENT_BYTES["fp32"],  # the head is replicated
        head_work_bytes=spec.head_work(model, micro_batch=micro_batch, seq_len=seq_len),
        boundary_bytes=tokens * model.dim * elem,
        memory_bytes=cluster.memory_gb * 1e9,
        overheads=device_overheads(cluster),
        p2p_bw=cluster.intra_gbps * 1e9,
        p2p_latency_s=cluster.latency_us * 1e-6,
        dp_bw=dp_gbps * 1e9,
        dp_latency_s=cluster.latency_us * 1e-6,
        group_create_s=cluster.group_create_ms * 1e-3,
        optimizer_s_per_param=(state.resident + state.moved) / (cluster.hbm_gbps * 1e9),
        checkpoint_bw=cluster.checkpoint_gbps * 1e9,
        restart_s=cluster.restart_s,
        n_devices=cluster.n_devices,
        devices_per_node=cluster.devices_per_node,
    )


def _timed(fn, *, warmup: int = 2, reps: int = 5) -> float:
    """The least CPU time of ``reps`` calls: time spent waiting for a core (others' jobs) does not count."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        samples.append(time.process_time() - start)
    return min(samples)


class KeptStorages(TorchDispatchMode):
    """Records every storage the ops under it create; :meth:`alive` sums those still alive afterwards.

    Run over a forward, that is what autograd (and recomputation's checkpoints) keep for the
    backward: the activations, whatever mechanism holds them.
    """

    def __init__(self):
        super().__init__()
        self._made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                known = self._made.get(storage.data_ptr())
                if known is None or known[0].expired():  # new, or memory a freed storage held, reused
                    self._made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive(self, *, besides: Iterable[Tensor] = ()) -> int:
        """Bytes of the recorded storages still alive, those of ``besides`` left out."""
        left_out = {t.untyped_storage().data_ptr() for t in besides}
        return sum(n for ptr, (ref, n) in self._made.items() if ptr not in left_out and not ref.expired())


def _fwd_bwd(model: ModelConfig, params: dict, x, targets, *, layers, first, last,
             recompute: str = "none") -> tuple[float, float, int]:
    """Fastest forward and backward seconds of one stage call, and the bytes its forward kept for backward."""

    def forward():
        return spec_of(model).stage_forward(params, model, x, layers=layers, first=first, last=last, targets=targets,
                                            recompute=recompute)

    with KeptStorages() as kept:
        out = forward()
    kept_bytes = kept.alive(besides=(out, x, *params.values()))
    grad = torch.ones_like(out)
    fwd = _timed(forward)
    outs = [forward() for _ in range(7)]
    samples = []
    for o in outs:
        start = time.process_time()
        o.backward(grad)
        samples.append(time.process_time() - start)
    return fwd, min(samples[2:]), kept_bytes


def measure_profile(
    model: ModelConfig, cluster: ClusterConfig, *, micro_batch: int, seq_len: int, key: str, threads: int = 1,
    recompute: str = "none",
) -> Profile:
    """Time the real model on this CPU with ``threads`` torch threads; gloo costs with ``cluster.comm_procs`` processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(model, cluster, micro_batch=micro_batch, seq_len=seq_len, key=key, recompute=recompute)
    finally:
        torch.set_num_threads(before)


def _measure(model: ModelConfig, cluster: ClusterConfig, *, micro_batch: int, seq_len: int, key: str,
             recompute: str) -> Profile:
    torch.manual_seed(0)
    spec = spec_of(model)
    names = spec.stage_param_names(model, (0, 1), first=True, last=True)
    params = {n: t.requires_grad_() for n, t in spec.init_params(model, 0, names=names).items()}
    tokens = torch.randint(0, model.vocab_size, (micro_batch, seq_len))
    hidden = torch.randn(micro_batch, seq_len, model.dim, requires_grad=True)
    by_mode = {mode: _fwd_bwd(model, params, hidden, None, layers=(0, 1), first=False, last=False, recompute=mode)
               for mode in Recompute}
    layer_f, layer_b, layer_act = by_mode[recompute]
    plain_f, plain_b, whole = by_mode[Recompute.none]
    terms = tuple(RecomputeTerms(mode, max(0.0, (b - plain_b) / plain_f), kept, whole - kept)
                  for mode, (_, b, kept) in by_mode.items())
    first_f, first_b, first_act = _fwd_bwd(model, params, tokens, None, layers=(0, 0), first=True, last=False)
    last_f, last_b, last_act = _fwd_bwd(model, params, hidden, tokens, layers=(1, 1), first=False, last=True)
    layer_p, first_p, last_p = spec.unit_params(model)
    layer_names = spec.stage_param_names(model, (0, 1), first=False, last=False)
    layer = {n: params[n].detach() for n in layer_names}
    grads, moments = {n: torch.randn_like(t) for n, t in layer.items()}, init_moments(layer)
    opt_s = _timed(lambda: adamw(layer, grads, moments, 1, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                                 weight_decay=0.0)) / layer_p  # the update the runtime applies
    comm = measure_comm(n_procs=cluster.comm_procs)
    cores = len(os.sched_getaffinity(0))
    boundary = micro_batch * seq_len * model.dim * ELEMENT_BYTES["fp32"]
    # TP sizes whose every process gets a core of its own, as the profile's times assume
    timed = measure_tensor_parallel(model, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute,
                                    sizes=[t for t in model.tp_sizes if 1 < t <= min(cluster.comm_procs, cores)])
    beyond = {t: TPTerms(t, fwd - layer_f / t, bwd - layer_b / t, fwd_idle, bwd_idle)
              for t, (fwd, bwd, fwd_idle, bwd_idle) in timed.items()}
    activation_all_reduce = partial(ring_all_reduce_s, comm["allreduce_latency_s"], comm["allreduce_bw"], boundary)
    counts = count_tp_all_reduces(model, params, hidden, recompute=recompute)
    return Profile(
        key=key,
        source=f"measured on this host ({os.cpu_count()} CPUs, {torch.get_num_threads()} threads)",
        n_layers=model.n_layers,
        micro_batch=micro_batch,
        seq_len=seq_len,
        tp=1,
        layer_fwd_s=layer_f,
        layer_bwd_s=layer_b,
        first_fwd_s=first_f,
        first_bwd_s=first_b,
        last_fwd_s=last_f,
        last_bwd_s=last_b,
        layer_params=layer_p,
        first_params=first_p,
        last_params=last_p,
        dtype="fp32",
        layer_act_bytes=layer_act,
        layer_rebuilt_bytes=whole - layer_act,
        recompute=recompute,
        recompute_terms=terms,
        first_act_bytes=first_act,
        last_act_bytes=last_act,
        head_work_bytes=spec.head_work(model, micro_batch=micro_batch, seq_len=seq_len),
        boundary_bytes=boundary,
        p2p_bw=comm["p2p_bw"],
        p2p_latency_s=comm["p2p_latency_s"],
        dp_bw=comm["allreduce_bw"],
        dp_latency_s=comm["allreduce_latency_s"],
        group_create_s=comm["group_create_s"],
        optimizer_s_per_param=opt_s,
        host_cores=cores,
        commit_s=comm["commit_s"],
        tp_terms=tp_terms(model.tp_sizes, beyond, activation_all_reduce, counts),
        **_configured(cluster),
    )


def _configured(cluster: ClusterConfig) -> dict:
    """A local profile's figures the cluster config gives, not measured: memory per device (this host's RAM ÷
    ``n_devices`` when not given) and its overheads, checkpoint bandwidth, restart time and the cluster's shape."""
    memory = cluster.memory_gb * 1e9 if cluster.memory_gb is not None else _host_memory() / cluster.n_devices
    return dict(memory_bytes=memory, overheads=device_overheads(cluster), checkpoint_bw=cluster.checkpoint_gbps * 1e9,
                restart_s=cluster.restart_s, n_devices=cluster.n_devices, devices_per_node=cluster.devices_per_node)


def device_overheads(cluster: ClusterConfig) -> DeviceOverheads:
    """What ``cluster.context_gb``, ``communicator_gb`` and ``allocator_reserve`` say a device holds besides a plan's
    tensors.

    Raises:
        ValueError: naming a key out of range.
    """
    for key in ("context_gb", "communicator_gb"):
        if getattr(cluster, key) < 0:
            raise ValueError(f"cluster.{key}={getattr(cluster, key)}: use ≥ 0 GB (what a device holds besides the plan)")
    if not 0 <= cluster.allocator_reserve < 1:
        raise ValueError(f"cluster.allocator_reserve={cluster.allocator_reserve}: a fraction of the peak, in [0, 1)")
    return DeviceOverheads(cluster.context_gb * 1e9, cluster.communicator_gb * 1e9, cluster.allocator_reserve)


def measure_tensor_parallel(model: ModelConfig, *, micro_batch: int, seq_len: int, recompute: str,
                            sizes: Iterable[int]) -> dict[int, tuple[float, float, float, float]]:
    """Wall seconds of one real TP layer's forward and backward at each TP size in ``sizes``, and of each the
    part its process spent with no thread on a core (wall − the process's CPU time).

    ``max(sizes)`` gloo processes with this process's torch threads; for each size ``t`` the first
    ``t`` run their shard of a layer (the spec's TP rules and ``tp_ops``), every all-reduce waited on
    by handing ``Work.wait()`` to a waiter thread as the runtime's generation does. Each size keeps
    the median of 16 rounds of 4 back-to-back micro-batches: a hand-off's wake-up varies from one to the
    next, and the runtime pays the typical one. Wall time: on a busy host others' jobs count too.
    """
    import torch.multiprocessing as mp

    sizes = sorted(sizes)
    if not sizes:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        mp.start_processes(
            _tp_worker, args=(max(sizes), _free_port(), model, micro_batch, seq_len, recompute, sizes,
                              torch.get_num_threads(), str(out)),
            nprocs=max(sizes), start_method="spawn",
        )
        return {int(t): tuple(times) for t, times in json.loads(out.read_text()).items()}


def _tp_worker(rank: int, world: int, port: int, model: ModelConfig, micro_batch: int, seq_len: int, recompute: str,
               sizes: list[int], threads: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    times = {}
    for tp in sizes:
        group = dist.new_group(list(range(tp)))
        if rank < tp:
            times[tp] = _time_tp_layer(model, group, rank, tp, micro_batch=micro_batch, seq_len=seq_len,
                                       recompute=recompute)
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _clocks() -> tuple[float, float]:
    """Wall and this process's CPU seconds now."""
    return time.perf_counter(), time.process_time()


def _time_tp_layer(model: ModelConfig, group, rank: int, tp: int, *, micro_batch: int, seq_len: int, recompute: str,
                   rounds: int = 16, calls: int = 4) -> tuple[float, float, float, float]:
    """Wall seconds of a forward and a backward of TP shard ``rank`` of one layer, and of each the seconds this
    process had no thread on a core: the median over ``rounds`` of each round's mean over ``calls``."""
    import torch.distributed as dist

    spec = spec_of(model)
    shapes, names = spec.param_shapes(model), spec.stage_param_names(model, (0, 1), first=False, last=False)
    whole = spec.init_params(model, 0, names=names)
    params = {}
    for n in names:
        region = shard_region(shapes[n], placements_for(n, rules=spec.tp_rules), rank, tp)
        params[n] = whole[n][tuple(slice(*r) for r in region)].clone().requires_grad_()
    torch.manual_seed(0)
    x = torch.randn(micro_batch, seq_len, model.dim, requires_grad=True)
    grad = torch.ones_like(x)
    rounds_fwd, rounds_bwd = [], []  # per round: (wall, idle) seconds per call
    with ThreadPoolExecutor(max_workers=1) as waiter:

        def all_reduce(tensor: Tensor) -> None:
            waiter.submit(dist.all_reduce(tensor, group=group, async_op=True).wait).result()

        ops = spec.tp_ops(all_reduce)
        for _ in range(rounds + 1):  # the first round warms up
            dist.barrier(group=group)
            clocks = []
            for _ in range(calls):
                start = _clocks()
                out = spec.stage_forward(params, model, x, layers=(0, 1), first=False, last=False, tp=ops,
                                         recompute=recompute)
                middle = _clocks()
                out.backward(grad)
                clocks.append((start, middle, _clocks()))
            for kept, (a, b) in ((rounds_fwd, (0, 1)), (rounds_bwd, (1, 2))):
                wall = sum(c[b][0] - c[a][0] for c in clocks) / calls
                cpu = sum(c[b][1] - c[a][1] for c in clocks) / calls
                kept.append((wall, max(0.0, wall - cpu)))
    (fwd_s, fwd_idle), (bwd_s, bwd_idle) = (map(statistics.median, zip(*kept[1:])) for kept in (rounds_fwd, rounds_bwd))
    return fwd_s, bwd_s, fwd_idle, bwd_idle


_SPIN = (
    "import time\n"
    "wall, cpu = time.perf_counter(), time.process_time()\n"
    "while time.perf_counter() - wall < {seconds}:\n"
    "    pass\n"
    "print((time.process_time() - cpu) / (time.perf_counter() - wall))\n"
)


def measure_background(cores: int, *, seconds: float = 0.5) -> float:
    """How many CPU-bound processes of other jobs share the ``cores`` now: 0 on an idle host.

    ``cores`` processes spin for ``seconds`` and report their CPU time over wall
    time; a fair scheduler gives each ``s = C / (C + n)`` of a core when ``n`` other
    processes are busy, so ``n = C/s − C``.
    """
    procs = [
        subprocess.Popen([sys.executable, "-c", _SPIN.format(seconds=seconds)], stdout=subprocess.PIPE, text=True)
        for _ in range(cores)
    ]
    share = statistics.mean(float(p.communicate()[0]) for p in procs)
    return max(0.0, cores / max(share, 1e-3) - cores)


def _commit_round_trip(rank: int, *, reps: int) -> list[float]:
    """Rank 1 (a worker) sets ``synced/i``; rank 0 (the controller) waits for it and sets ``commit/i``. Every rank of
    the default group calls it: rank 0's store takes a port the system picks and tells it (a port picked ahead could
    be taken meanwhile by a gloo connection's)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    if rank > 1:
        return []
    store = store or dist.TCPStore("127.0.0.1", port[0], 2, False)
    times = []
    for i in range(reps):
        if rank == 0:
            store.wait([f"synced/{i}"])
            store.set(f"commit/{i}", "1")
        else:
            start = time.perf_counter()
            store.set(f"synced/{i}", "1")
            store.wait([f"commit/{i}"])
            times.append(time.perf_counter() - start)
    if rank == 0:
        store.wait(["done"])  # the store lives in this process: keep it until the worker has its last key
    else:
        store.set("done", "1")
    return times


def _host_memory() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_comm(*, n_procs: int = 3, small: int = 1 << 10, large: int = 1 << 22) -> dict[str, float]:
    """Gloo costs on this host with ``n_procs`` real processes (2..4).

    Returns:
        ``p2p_bw``/``p2p_latency_s`` from a small and a large send; ``allreduce_bw`` (bus
        bandwidth, i.e. for ``2(n−1)/n · bytes``) and ``allreduce_latency_s`` fitted over
        group sizes 2..n_procs; ``group_create_s``, the mean ``new_group`` time;
        ``commit_s``, a commit's round trip stood for by two loopback TCP messages (a worker
        sets a key in a store, the controller answers with another, the worker wakes); the
        runtime's pushed commit (worker → agent → controller → agent → worker) adds two
        node-local pipe hops and skips the store's own protocol.
    """
    import torch.multiprocessing as mp

    if not 2 <= n_procs <= 4:
        raise ValueError(f"cluster.comm_procs={n_procs}: use 2 to 4 processes")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        mp.start_processes(
            _comm_worker, args=(n_procs, _free_port(), small, large, str(out)), nprocs=n_procs,
            start_method="spawn",
        )
        return json.loads(out.read_text())


def _comm_worker(rank: int, world: int, port: int, small: int, large: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    reps = 5

    def p2p(nbytes: int) -> float:
        buf = torch.zeros(nbytes // 4)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        return (time.perf_counter() - start) / (2 * reps)

    t_small, t_large = p2p(small), p2p(large)
    create, fits = [], []
    for n in range(2, world + 1):
        start = time.perf_counter()
        group = dist.new_group(list(range(n)))
        create.append(time.perf_counter() - start)
        for nbytes in (small, large):
            buf = torch.zeros(nbytes // 4)
            dist.barrier()
            start = time.perf_counter()
            if rank < n:
                for _ in range(reps):
                    dist.all_reduce(buf, group=group)
            fits.append((n, nbytes, (time.perf_counter() - start) / reps))
    commit = _commit_round_trip(rank, reps=20)
    dist.barrier()
    if rank == 1:
        Path(out + ".commit").write_text(json.dumps(statistics.median(commit)))
    dist.barrier()
    if rank == 0:
        lat = statistics.mean(t for _, b, t in fits if b == small)
        bus = [2 * (n - 1) / n * b / max(t - lat, 1e-9) for n, b, t in fits if b == large]
        Path(out).write_text(json.dumps({
            "p2p_latency_s": t_small,
            "p2p_bw": (large - small) / max(t_large - t_small, 1e-9),
            "allreduce_latency_s": lat,
            "allreduce_bw": statistics.median(bus),
            "group_create_s": statistics.mean(create),
            "commit_s": json.loads(Path(out + ".commit").read_text()),
        }))
    dist.destroy_process_group()
