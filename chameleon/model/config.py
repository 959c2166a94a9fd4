"""Model hyper-parameters (a Hydra structured config, group ``model``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Decoder hyper-parameters; ``arch`` picks the architecture (:func:`chameleon.model.spec.spec_of`).

    The fields are Llama-2's; another architecture reads the ones it documents.
    ``ffn_hidden_dim`` follows Llama-2's rule: ``2/3 · 4 · dim``, scaled by
    ``ffn_dim_multiplier`` when set, rounded up to a multiple of ``multiple_of``.
    """

    name: str = "tiny"
    arch: str = "llama"  # llama | gpt
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    multiple_of: int = 32
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    init: str = "random"  # random (seeded by train.seed) | hf:PATH (a Hugging Face Llama checkpoint directory)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)
