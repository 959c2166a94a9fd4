"""AdamW and global-norm clipping as pure functions over parameter trees (the learning rate: :mod:`chameleon.schedule`).

A tree is a flat ``{name: Tensor}`` dict, as the model's parameters are. Nothing here
mutates its inputs or holds state: the optimizer state (``exp_avg``, ``exp_avg_sq``)
goes in and comes out, and the step count and learning rate are arguments — both
derived from the *global* step, so a run resumed at any step, on any plan, continues
exactly where it left off. The arithmetic is ``torch.optim.AdamW``'s (single-tensor
path) and ``torch.nn.utils.clip_grad_norm_``'s, operation for operation, run as
multi-tensor ops (``torch._foreach_*``): one launch per operation for a whole stage.
:func:`adamw_` is the in-place form a stage's own state is updated with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

Tree = Mapping[str, Tensor]
MOMENTS = ("exp_avg", "exp_avg_sq")


CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
GROUP_ELEMS = 1 << 26  # elements per multi-tensor group (256 MiB of fp32): bounds the update's transient memory


def init_moments(params: Tree) -> dict[str, dict[str, Tensor]]:
    """Zero AdamW moments for ``params``: ``{"exp_avg": tree, "exp_avg_sq": tree}``."""
    return {kind: {n: torch.zeros_like(p) for n, p in params.items()} for kind in MOMENTS}


def adamw(
    params: Tree, grads: Tree, moments: Mapping[str, Tree], step: int, *, lr: float, **hyper: float
) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
    """One AdamW update (decoupled weight decay), returning new parameters and moments.

    Args:
        params: the parameters (fp32 masters).
        grads: their gradients, same names and shapes.
        moments: ``{"exp_avg": tree, "exp_avg_sq": tree}`` before this update.
        step: the 1-based update count (bias correction uses it): global step + 1.
        lr: this step's learning rate (see :func:`learning_rate`).
        hyper: ``beta1``, ``beta2``, ``eps``, ``weight_decay``, as :func:`adamw_` takes them.

    Returns:
        ``(params, moments)`` after the update; the inputs are left untouched.
    """
    names = list(params)
    new_params = {n: params[n].clone() for n in names}
    new_moments = {kind: {n: moments[kind][n].clone() for n in names} for kind in MOMENTS}
    adamw_([new_params[n] for n in names], [grads[n] for n in names], [new_moments["exp_avg"][n] for n in names],
           [new_moments["exp_avg_sq"][n] for n in names], step, lr=lr, **hyper)
    return new_params, new_moments


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`adamw` in place on lists of tensors, one multi-tensor (``torch._foreach_*``) op per stage of the update.

    The ops are the single-tensor path's, in its order: on CPU the results are its bits; on an
    accelerator each op is one launch over a group of tensors instead of one per tensor. Groups
    hold up to :data:`GROUP_ELEMS` elements, so the transient (one denominator per element) stays
    bounded, not a copy of the whole stage.

    Raises:
        ValueError: ``step < 1``.
    """
    if step < 1:
        raise ValueError(f"step={step}: AdamW counts updates from 1")
    bias1, bias2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
    for group in _groups([p.numel() for p in params], GROUP_ELEMS):
        p, g, m, v = ([t[i] for i in group] for t in (params, grads, exp_avgs, exp_avg_sqs))
        if weight_decay:
            torch._foreach_mul_(p, 1 - lr * weight_decay)
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(p, m, denom, value=-lr / bias1)


def _groups(sizes: list[int], limit: int) -> list[range]:
    """Consecutive index ranges of ``sizes`` summing to at most ``limit`` each (a larger one alone)."""
    groups, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    return groups + ([range(start, len(sizes))] if start < len(sizes) else [])


def sum_of_squares(tensors: Iterable[Tensor], *, device: torch.device) -> Tensor:
    """``Σ ‖t‖²`` over ``tensors`` as a 1-element fp32 tensor on ``device`` (zero when there are none).

    Summed per device over disjoint pieces that tile every tensor once, then over
    devices (by the controller), this gives the square of the global gradient norm.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum().reshape(1)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``min(1, max_norm / (total_norm + 1e-6))`` gradients are scaled by; 1 when ``max_norm ≤ 0``.

    Computed in fp32 exactly as ``torch.nn.utils.clip_grads_with_norm_`` does, so the
    same norm scales the same gradients to the same bits.
    """
    if max_norm <= 0:
        return 1.0
    coefficient = (torch.tensor(total_norm, dtype=torch.float32) + CLIP_EPS).reciprocal() * max_norm
    return torch.clamp(coefficient, max=1.0).item()


def scale_(tensors: list[Tensor], factor: float) -> None:
    """Every tensor times ``factor``, in place, as one multi-tensor op (nothing to do when ``factor == 1``)."""
    if factor != 1.0:
        torch._foreach_mul_(tensors, factor)


def hyperparameters(train) -> dict:
    """The :func:`adamw` keywords other than ``lr`` of a ``train`` config."""
    return {k: getattr(train, k) for k in ("beta1", "beta2", "eps", "weight_decay")}
