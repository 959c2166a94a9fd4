"""The oracle every fault test and the chaos soak use: did a run lose or redo anything?

Two runs of the same model, data and steps that trained exactly the same samples
differ only by floating-point reassociation: gradients summed in another order
(another layout, a recovery that changed it). Losses stay within ~1e-6, but AdamW
amplifies the last bits of tiny gradients, so parameters drift apart slowly — some
1e-5 after tens of steps between two failure-free layouts. A lost, duplicated or
redone step moves parameters by about the learning rate (~1e-3 relative here) and
losses by far more than 1e-5. So a run passes when, against the failure-free run of
its starting layout:

- it trained the same samples at every step (identical sample digest);
- every step's loss is within ``LOSS_TOLERANCE`` (relative);
- its final parameters are within ``max(PARAM_FLOOR, DRIFT_FACTOR · drift)``
  (relative, per tensor), where ``drift`` is the difference between two failure-free
  runs of different layouts over the same steps: the noise floor, measured, not assumed.
"""

from __future__ import annotations

import torch

LOSS_TOLERANCE = 1e-5
PARAM_FLOOR = 1e-5
DRIFT_FACTOR = 4.0


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor ``‖a − b‖ / ‖b‖``.

    Raises:
        ValueError: the two hold different tensors.
    """
    if a.keys() != b.keys():
        raise ValueError(f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


def param_tolerance(drift: float) -> float:
    """The parameter bound for a noise floor of ``drift``."""
    return max(PARAM_FLOOR, DRIFT_FACTOR * drift)


def mismatches(summary: dict, params: dict[str, torch.Tensor], reference: dict,
               reference_params: dict[str, torch.Tensor], *, drift: float = 0.0) -> list[str]:
    """Everything in which a run differs from its reference beyond the criterion (empty: nothing lost)."""
    out = []
    if summary["steps_completed"] != reference["steps_completed"]:
        out.append(f"{summary['steps_completed']} steps committed, not {reference['steps_completed']}")
    if summary["sample_ids_digest"] != reference["sample_ids_digest"]:
        out.append("the steps trained other samples (sample digest differs)")
    for step, (a, b) in enumerate(zip(summary["losses"], reference["losses"])):
        if abs(a - b) > LOSS_TOLERANCE * abs(b):
            out.append(f"loss of step {summary['first_step'] + step} is {a:.7g}, not {b:.7g}")
            break
    diff = relative_difference(params, reference_params)
    if diff > param_tolerance(drift):
        out.append(f"parameters differ by {diff:.2e} (relative), beyond {param_tolerance(drift):.2e}")
    return out
