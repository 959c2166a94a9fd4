"""The global sample stream: sample ``i`` is a fixed token window, whatever the layout.

Step ``k`` trains samples ``[k·B, (k+1)·B)``; global micro-batch ``m`` of that step
holds samples ``[k·B + m·b, k·B + (m+1)·b)``. Samples map to non-overlapping windows
of the corpus, reshuffled each epoch by a seeded permutation, so any process can
rebuild any sample from its id alone.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

import torch

BUNDLED_CORPUS = "paradise_lost.txt"
VOCAB_SIZE = 256


def encode(text: str) -> torch.Tensor:
    """Byte-level tokenizer: UTF-8 bytes as int64 token ids in ``[0, 256)``."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def load_corpus(path: str | None) -> str:
    """The user's text file, or the bundled public-domain corpus when ``path`` is None."""
    if path is None:
        return resources.files("chameleon.data").joinpath(BUNDLED_CORPUS).read_text(encoding="utf-8")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"data.path={path!r} is not a file: give a UTF-8 text file or null for the bundled corpus")
    return file.read_text(encoding="utf-8")


class SampleStream:
    """Deterministic samples: ``(inputs, targets)`` windows of ``seq_len`` tokens by global id."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (len(tokens) - 1) // seq_len
        self._permutations: dict[int, torch.Tensor] = {}
        if self.n_windows < 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than train.seq_len+1={seq_len + 1}")

    @classmethod
    def from_config(cls, *, path: str | None, seq_len: int, seed: int) -> SampleStream:
        return cls(encode(load_corpus(path)), seq_len=seq_len, seed=seed)

    def _window(self, sample_id: int) -> int:
        epoch, index = divmod(sample_id, self.n_windows)
        perm = self._permutations.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = self._permutations[epoch] = torch.randperm(self.n_windows, generator=gen)
        return int(perm[index])

    def batch(self, sample_ids: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked ``(inputs, targets)`` of shape ``[len(sample_ids), seq_len]``; targets are inputs shifted by one."""
        starts = [self._window(i) * self.seq_len for i in sample_ids]
        windows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:]


def micro_batch_samples(step: int, micro_batch: int, *, global_batch: int, micro_batch_size: int) -> range:
    """Global sample ids of global micro-batch ``micro_batch`` of ``step``."""
    start = step * global_batch + micro_batch * micro_batch_size
    return range(start, start + micro_batch_size)


def sample_ids_digest(per_step_ids: list[list[int]]) -> str:
    """SHA-256 over the sorted sample ids of each step: equal for any layout training the same steps."""
    h = hashlib.sha256()
    for step, ids in enumerate(per_step_ids):
        h.update(f"{step}:{','.join(map(str, sorted(ids)))};".encode())
    return h.hexdigest()
