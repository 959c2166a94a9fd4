"""Model hyper-parameters (a Hydra structured config, group ``model``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Decoder hyper-parameters; ``arch`` picks the architecture (:func:`chameleon.model.spec.spec_of`).

    The fields are Llama's; another architecture reads the ones it documents.
    ``ffn_hidden_dim`` follows Llama's rule: ``2/3 · 4 · dim``, scaled by
    ``ffn_dim_multiplier`` when set, rounded up to a multiple of ``multiple_of``.
    ``rope_scaling=llama3`` rescales the rotary frequencies as Llama 3.1 does
    (:func:`chameleon.model.llama.rope_frequencies`), reading the four ``rope_*`` numbers
    after it; with ``null`` they are unused.
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
    rope_scaling: str | None = None  # null (plain RoPE) | llama3 (Llama 3.1's frequency-dependent scaling)
    rope_factor: float = 8.0  # llama3: long wavelengths are divided by it
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above rope_original_max_seq_len / this are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below rope_original_max_seq_len / this are kept
    rope_original_max_seq_len: int = 8192  # llama3: the context the model was pre-trained at
    max_seq_len: int = 4096
    init: str = "random"  # random (seeded by train.seed) | hf:PATH (a Hugging Face Llama checkpoint directory)

    def __post_init__(self) -> None:
        if self.rope_scaling not in (None, "llama3"):
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r}: use null (plain RoPE) or llama3")
        if self.rope_scaling is not None and not (
            self.rope_factor > 0 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_max_seq_len >= 1
        ):
            raise ValueError(
                f"model.rope_factor={self.rope_factor} model.rope_low_freq_factor={self.rope_low_freq_factor} "
                f"model.rope_high_freq_factor={self.rope_high_freq_factor} "
                f"model.rope_original_max_seq_len={self.rope_original_max_seq_len}: model.rope_scaling=llama3 needs "
                "rope_factor > 0, 0 < rope_low_freq_factor < rope_high_freq_factor and rope_original_max_seq_len ≥ 1"
            )

    @property
    def rope_scaling_params(self) -> tuple[float, float, float, int] | None:
        """``(factor, low_freq_factor, high_freq_factor, original_max_seq_len)`` under llama3 scaling, else None."""
        if self.rope_scaling is None:
            return None
        return self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_seq_len

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """The tensor-parallel sizes the heads allow: the divisors of ``gcd(n_heads, n_kv_heads)``."""
        heads = math.gcd(self.n_heads, self.n_kv_heads)
        return tuple(t for t in range(1, heads + 1) if heads % t == 0)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)
