"""Memory a plan needs per device, and memory the devices offer (for fail-fast validation)."""

from __future__ import annotations

import math
import os

from chameleon.layout.plan import Plan
from chameleon.model.config import ModelConfig
from chameleon.model.llama import param_shapes, stage_param_names
from chameleon.runtime.device import import_torch_npu

# fp32 master parameter + fp32 gradient + AdamW exp_avg + exp_avg_sq; bf16 adds its 2-byte compute copy.
STATE_BYTES_PER_PARAM = 16
COMPUTE_BYTES = {"fp32": 4, "bf16": 2}  # per element of activations (and of the compute copy)


def activation_bytes_per_layer(cfg: ModelConfig, *, micro_batch: int, seq_len: int, dtype: str = "fp32") -> int:
    """Activations (fp32 or bf16) one transformer block keeps for backward, per micro-batch.

    Counts the saved inputs of norms, q/k/v/o, the SwiGLU branches, and the
    attention probabilities of the math SDPA path (``heads · seq²``).
    """
    tokens = micro_batch * seq_len
    per_token = 8 * cfg.dim + 2 * cfg.n_kv_heads * cfg.head_dim + 3 * cfg.ffn_hidden_dim
    return COMPUTE_BYTES[dtype] * (tokens * per_token + micro_batch * cfg.n_heads * seq_len * seq_len)


def plan_memory_bytes(cfg: ModelConfig, plan: Plan, *, seq_len: int, dtype: str = "fp32") -> dict[int, int]:
    """Peak bytes each device of ``plan`` needs: sharded state plus 1F1B in-flight activations (``train.dtype``)."""
    shapes = param_shapes(cfg)
    act = activation_bytes_per_layer(cfg, micro_batch=plan.micro_batch_size, seq_len=seq_len, dtype=dtype)
    per_param = STATE_BYTES_PER_PARAM + (COMPUTE_BYTES[dtype] if dtype != "fp32" else 0)
    need: dict[int, int] = {}
    for pipe in plan.pipelines:
        for s, stage in enumerate(pipe.stages):
            if not stage.devices:
                continue
            names = stage_param_names(cfg, stage.layers, first=s == 0, last=s == pipe.n_stages - 1)
            state = sum(math.prod(shapes[n]) for n in names) * per_param // stage.tp
            in_flight = min(pipe.n_stages - s, pipe.micro_batches)
            activations = in_flight * stage.n_layers * act // stage.tp
            for device in stage.devices:
                need[device] = state + activations
    return need


def device_memory_bytes(launcher) -> tuple[int, int]:
    """(bytes one device offers, bytes all ``nnodes · nproc_per_node`` devices offer together).

    CPU workers share their host's RAM; accelerators each have their own memory.
    ``launcher.memory_per_device_gb`` overrides what is detected.
    """
    if launcher.memory_per_device_gb:
        per = int(launcher.memory_per_device_gb * 2**30)
        return per, per * launcher.nnodes * launcher.nproc_per_node
    if launcher.device == "cpu":
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return host, host * launcher.nnodes
    import torch

    if launcher.device == "npu":
        import_torch_npu()
    elif not torch.cuda.is_available():
        raise RuntimeError("launcher.device=cuda but no CUDA device is visible: use launcher.device=cpu")
    backend = torch.cuda if launcher.device == "cuda" else torch.npu
    per = backend.get_device_properties(0).total_memory
    return per, per * launcher.nnodes * launcher.nproc_per_node
