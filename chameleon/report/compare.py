"""The oracle every fault test and the chaos soak use: did a run lose or redo anything?

Two runs of the same model, data and steps that trained exactly the same samples
differ only by floating-point reassociation: gradients summed in another order
(another layout, a recovery that changed it). Over a few steps that stays below
1e-5 (relative) in losses and parameters. Over tens of steps the difference grows:
AdamW amplifies the last bits of tiny gradients, and a clipped step scales every
gradient by a coefficient that itself carries the difference, so two failure-free
layouts end up apart by 1e-5 … 1e-3 in parameters and up to ~1e-4 in losses (see
``docs/recovery.md``). A lost, duplicated or redone sample or step moves the next
losses by 1e-3 … 1e-1. So a run passes when, against the failure-free run of its
starting layout:

- it trained the same samples at every step (identical sample digest);
- every step's loss, and every validation loss (taken before the same steps), is within
  ``max(FLOOR, DRIFT_FACTOR · drift.loss)`` (relative);
- its final parameters are within ``max(FLOOR, DRIFT_FACTOR · drift.params)``
  (relative, per tensor);

where ``drift`` is the difference between two failure-free runs of different
layouts over the same steps (:meth:`Drift.between`): the noise floor, measured, not
assumed. Short runs (drift below the floor) are held to 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOOR = 1e-5
DRIFT_FACTOR = 4.0


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor ``‖a − b‖ / ‖b‖``.

    Raises:
        ValueError: the two hold different tensors.
    """
    if a.keys() != b.keys():
        raise ValueError(f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


def length_difference(losses: list[float], reference: list[float],
                      names: tuple[str, str] = ("the run", "the reference")) -> str:
    """Which of two loss lists is shorter, and by how many steps; empty when they are as long."""
    n, m = sorted((len(losses), len(reference)))
    if n == m:
        return ""
    short, long = names if len(losses) < len(reference) else names[::-1]
    return f"{short} has {m - n} step loss(es) fewer than {long} ({n}, not {m})"


def loss_difference(a: list[float], b: list[float]) -> float:
    """Largest per-step ``|a − b| / |b|``.

    Raises:
        ValueError: the two hold different numbers of steps.
    """
    if why := length_difference(a, b, ("the first", "the second")):
        raise ValueError(why)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Drift:
    """The noise floor: how far two failure-free runs of different layouts end apart (relative)."""

    loss: float = 0.0
    params: float = 0.0

    @classmethod
    def between(cls, summary_a: dict, params_a: dict, summary_b: dict, params_b: dict) -> Drift:
        return cls(loss_difference(summary_a["losses"], summary_b["losses"]), relative_difference(params_a, params_b))

    @property
    def loss_tolerance(self) -> float:
        return max(FLOOR, DRIFT_FACTOR * self.loss)

    @property
    def param_tolerance(self) -> float:
        return max(FLOOR, DRIFT_FACTOR * self.params)


def mismatches(summary: dict, params: dict[str, torch.Tensor], reference: dict,
               reference_params: dict[str, torch.Tensor], *, drift: Drift = Drift()) -> list[str]:
    """Everything in which a run differs from its reference beyond the criterion (empty: nothing lost)."""
    out = []
    if summary["steps_completed"] != reference["steps_completed"]:
        return [f"{summary['steps_completed']} steps committed, not {reference['steps_completed']}"]
    if summary["sample_ids_digest"] != reference["sample_ids_digest"]:
        out.append("the steps trained other samples (sample digest differs)")
    if why := length_difference(summary["losses"], reference["losses"]):
        out.append(why)
    for step, (a, b) in enumerate(zip(summary["losses"], reference["losses"])):  # the steps both have
        if abs(a - b) > drift.loss_tolerance * abs(b):
            out.append(f"loss of step {summary['first_step'] + step} is {a:.7g}, not {b:.7g} "
                       f"(bound {drift.loss_tolerance:.1e})")
            break
    got, want = dict(map(tuple, summary.get("val_losses", []))), dict(map(tuple, reference.get("val_losses", [])))
    if got.keys() != want.keys():
        out.append(f"validation losses taken before steps {sorted(got)}, not {sorted(want)}")
    for step in sorted(got.keys() & want.keys()):
        if abs(got[step] - want[step]) > drift.loss_tolerance * abs(want[step]):
            out.append(f"validation loss before step {step} is {got[step]:.7g}, not {want[step]:.7g} "
                       f"(bound {drift.loss_tolerance:.1e})")
            break
    diff = relative_difference(params, reference_params)
    if diff > drift.param_tolerance:
        out.append(f"parameters differ by {diff:.2e} (relative), beyond {drift.param_tolerance:.2e}")
    return out
