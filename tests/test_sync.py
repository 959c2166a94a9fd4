"""The gradient sync in buckets, launched as the last backward makes them final, against sums taken in one process."""

from __future__ import annotations

from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from chameleon.config import TrainConfig
from chameleon.layout.colouring import SyncGroup
from chameleon.layout.geometry import geometry_of, sync_rounds
from chameleon.layout.groups import plan_groups
from chameleon.layout.plan import even_plan
from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of
from chameleon.runtime.worker.comm import Generation
from chameleon.runtime.worker.schedule import GradientSync, cut_buckets
from chameleon.runtime.worker.stage import StageState, role_of
from conftest import run_ranks

MODEL = ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)
TRAIN = TrainConfig(global_batch=4, micro_batch=2, seq_len=8)


def test_buckets_are_cut_last_tensors_first_within_the_cap():
    regions = {"a": ((0, 4), (0, 4)), "b": ((0, 2), (0, 4)), "c": ((0, 8),), "d": ((0, 64),)}
    sync = SyncGroup(devices=(0, 1), names=("a", "b", "c", "d"))
    # fp32: a 64 B, b 32 B, c 32 B, d 256 B (over the cap: alone)
    assert [p.names for p in cut_buckets(sync, regions, 100)] == [("d",), ("c", "b"), ("a",)]
    assert [p.names for p in cut_buckets(sync, regions, float("inf"))] == [("d", "c", "b", "a")]
    assert all(p.devices == (0, 1) for p in cut_buckets(sync, regions, 100))


def _grads(state: StageState, tokens: torch.Tensor) -> None:
    """One micro-batch's forward and backward of this device's stage (one stage: the whole model)."""
    out = spec_of(MODEL).stage_forward(state.params, MODEL, tokens[:, :-1], layers=(0, MODEL.n_layers), first=True,
                                       last=True, targets=tokens[:, 1:], tp=None)
    out.backward()


def _micro_batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randint(0, MODEL.vocab_size, (2, TRAIN.seq_len + 1), generator=generator) for _ in range(2)]


def _rank(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    plan = even_plan(dp=world, pp=1, tp=1, n_layers=MODEL.n_layers, global_batch=TRAIN.global_batch,
                     micro_batch=TRAIN.micro_batch)
    layout = spec_of(MODEL).layout(MODEL, plan)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=30))
    gen = Generation(connect_store=lambda: store, generation=0, me=rank, backend="gloo", timeout_s=30,
                     groups=plan_groups(plan, layout))
    new_state = partial(StageState.create, MODEL, role_of(plan, rank), seed=0, train=TRAIN, device=torch.device("cpu"))
    reference = new_state()  # every device's micro-batches in this one process: the summed gradients
    for r in range(world):
        for tokens in _micro_batches(r):
            _grads(reference, tokens)

    state = new_state()
    sync = GradientSync(sync_rounds(geometry_of(plan), layout), state=state, gen=gen, bucket_bytes=4096)
    assert len(sync.buckets) > 3
    first, last = _micro_batches(rank)
    _grads(state, first)
    assert sync.launched == 0  # not watched: an earlier micro-batch's gradients are not final
    sync.watch()
    _grads(state, last)
    assert sync.launched == len(sync.buckets)  # every bucket posted during the last backward, none waited for
    own = new_state()
    for tokens in (first, last):
        _grads(own, tokens)
    names = list(state.regions)
    for got, mine in zip(state.grads(names), own.grads(names), strict=True):
        assert torch.equal(got, mine)  # the sums land at the end: until then the gradients are this device's own
    sync.finish()
    for got, want in zip(state.grads(names), reference.grads(names), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_buckets_are_launched_during_the_last_backward_and_sum_as_one_process():
    run_ranks(_rank, 2)
