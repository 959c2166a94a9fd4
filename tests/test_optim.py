"""The pure optimizer against torch's own AdamW and clip_grad_norm_, and schedules worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from chameleon.model.config import ModelConfig
from chameleon import optim
from chameleon.model.llama import LLAMA
from chameleon.optim import adamw, clip_coefficient, init_moments, scale_, sum_of_squares
from chameleon.schedule import learning_rate

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)
HP = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_with_clipping_and_schedule_is_torchs_bit_for_bit(weight_decay):
    """Five steps of ours (pure) and of torch.optim.AdamW + clip_grads_with_norm_ + LambdaLR from one start."""
    schedule = {"lr": 1e-2, "schedule": "cosine", "warmup_steps": 2, "total_steps": 5, "min_lr": 1e-3}
    max_norm = 0.5
    start = LLAMA.init_params(CFG, 0)
    ref = {n: t.clone().requires_grad_(True) for n, t in start.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=schedule["lr"], weight_decay=weight_decay, foreach=False,
                            betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: learning_rate(k, **schedule) / schedule["lr"])
    params, moments = dict(start), init_moments(start)
    clipped = 0
    for step, (tokens, targets) in enumerate(batches(5)):
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        LLAMA.full_forward_loss(leaves, CFG, tokens, targets).backward()
        grads = {n: p.grad for n, p in leaves.items()}
        norm = sum_of_squares(grads.values(), device=torch.device("cpu")).sqrt().item()
        factor = clip_coefficient(norm, max_norm)
        clipped += factor < 1
        scale_(list(grads.values()), factor)
        params, moments = adamw(params, grads, moments, step + 1,
                                lr=learning_rate(step, **schedule), weight_decay=weight_decay, **HP)

        LLAMA.full_forward_loss(ref, CFG, tokens, targets).backward()
        ref_grads = [p.grad for p in ref.values()]
        assert norm == pytest.approx(torch.nn.utils.get_total_norm(ref_grads).item(), rel=1e-6)
        torch.nn.utils.clip_grads_with_norm_(list(ref.values()), max_norm, torch.tensor(norm), foreach=False)
        opt.step()
        lam.step()
        opt.zero_grad()
        for n, p in ref.items():
            assert torch.equal(params[n], p.detach()), (step, n)
            assert torch.equal(moments["exp_avg"][n], opt.state[p]["exp_avg"]), (step, n)
            assert torch.equal(moments["exp_avg_sq"][n], opt.state[p]["exp_avg_sq"]), (step, n)
    assert clipped >= 3, "the test must exercise clipping"


def test_adamw_without_clipping_is_bitwise_torchs_and_pure():
    start = LLAMA.init_params(CFG, 3)
    grads = {n: torch.randn_like(t) for n, t in start.items()}
    ref = {n: t.clone().requires_grad_(True) for n, t in start.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=3e-3, weight_decay=0.1, foreach=False,
                            betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    params, moments = dict(start), init_moments(start)
    before = {n: t.clone() for n, t in start.items()}
    for step in range(1, 4):
        for n, p in ref.items():
            p.grad = grads[n].clone()
        opt.step()
        params, moments = adamw(params, grads, moments, step, lr=3e-3, weight_decay=0.1, **HP)
    for n, p in ref.items():
        assert torch.equal(params[n], p.detach()), n
        assert torch.equal(moments["exp_avg_sq"][n], opt.state[p]["exp_avg_sq"]), n
    assert all(torch.equal(start[n], before[n]) for n in start), "adamw must not modify its inputs"


def test_learning_rate_schedules_by_hand():
    cosine = {"lr": 1.0, "schedule": "cosine", "warmup_steps": 4, "total_steps": 14, "min_lr": 0.1}
    assert [learning_rate(k, **cosine) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(4, **cosine) == 1.0  # the decay starts at the peak
    assert learning_rate(9, **cosine) == pytest.approx(0.55)  # half-way: the mean of lr and min_lr
    assert learning_rate(13, **cosine) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.9)))
    assert learning_rate(100, **cosine) == pytest.approx(0.1)
    constant = {**cosine, "schedule": "constant", "warmup_steps": 0}
    assert {learning_rate(k, **constant) for k in range(20)} == {1.0}
    with pytest.raises(ValueError, match="train.lr_schedule"):
        learning_rate(0, **{**cosine, "schedule": "linear"})


def test_clip_coefficient_only_shrinks():
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(0.25)
    assert clip_coefficient(4.0, 0.0) == 1.0  # off
    grads = [torch.ones(3), torch.full((2, 2), 4.0)]
    scale_(grads, 1.0)
    assert torch.equal(grads[0], torch.ones(3))
    scale_(grads, 0.25)
    assert torch.equal(grads[0], torch.full((3,), 0.25)) and torch.equal(grads[1], torch.ones(2, 2))


def test_the_update_in_bounded_groups_is_the_update_at_once(monkeypatch):
    """Groups of at most ``GROUP_ELEMS`` elements bound the update's transient; the bits do not change."""
    start = LLAMA.init_params(CFG, 0)
    grads = {n: torch.randn_like(t) for n, t in start.items()}
    p1, m1 = adamw(start, grads, init_moments(start), 3, lr=1e-2, weight_decay=0.1, **HP)
    monkeypatch.setattr(optim, "GROUP_ELEMS", 100)
    assert len(optim._groups([t.numel() for t in start.values()], 100)) > len(start) // 2
    p2, m2 = adamw(start, grads, init_moments(start), 3, lr=1e-2, weight_decay=0.1, **HP)
    assert all(torch.equal(p1[n], p2[n]) for n in p1)
    assert all(torch.equal(m1[k][n], m2[k][n]) for k in m1 for n in m1[k])
    assert optim._groups([5, 5, 20, 1], 10) == [range(0, 2), range(2, 3), range(3, 4)] and optim._groups([], 10) == []
