"""The global sample stream: sample ``i`` is a fixed token window, whatever the layout.

Step ``k`` trains samples ``[k·B, (k+1)·B)``; global micro-batch ``m`` of that step
holds samples ``[k·B + m·b, k·B + (m+1)·b)``. A corpus is tokens with document
boundaries (token shards from ``python -m chameleon.prepare``, read window by window,
or a text file's UTF-8 bytes); a seeded choice of its documents is held out for validation.
Samples are non-overlapping windows of ``seq_len + 1`` tokens inside *segments*
(runs of consecutive training documents, or single documents with
``data.pack=document``), reshuffled each epoch by a seeded permutation that is a
pure function of the sample id (no table: memory does not grow with the corpus),
so any process can rebuild any sample from its id alone.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

BUNDLED_CORPUS = "paradise_lost.txt"
VOCAB_SIZE = 256
SPLIT_SEED = 0x5EED  # the validation split and its windows depend on the corpus alone, not on train.seed
_MASK64 = (1 << 64) - 1
_PARAGRAPH = re.compile(rb"\n[ \t\r]*\n\s*")


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


class ByteText:
    """A text's UTF-8 bytes as tokens; its paragraphs (split at blank lines) are its documents."""

    vocab_size = VOCAB_SIZE

    def __init__(self, text: str):
        self._bytes = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        self.n_tokens = len(self._bytes)
        starts = [0] + [m.end() for m in _PARAGRAPH.finditer(self._bytes.tobytes()) if m.end() < self.n_tokens]
        self._starts = np.array(starts, dtype=np.int64)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self._bytes[start:stop].astype(np.int64)

    def document_starts(self) -> np.ndarray:
        return self._starts


def open_corpus(path: str | None):
    """Tokens with document starts: prepared shards (a folder), a UTF-8 text file, or the bundled corpus (None)."""
    if path is not None and Path(path).expanduser().is_dir():
        from chameleon.data.shards import TokenShards

        return TokenShards.open(Path(path).expanduser())
    return ByteText(load_corpus(path))


def segments(starts: np.ndarray, n_tokens: int, chosen: np.ndarray, *, pack: str) -> np.ndarray:
    """``[k, 2]`` token ranges the windows of the ``chosen`` documents fall in.

    ``window``: runs of consecutive chosen documents, merged; ``document``: each chosen document alone.
    """
    ends = np.append(starts[1:], n_tokens)
    lo, hi = starts[chosen], ends[chosen]
    if pack == "window" and len(lo):
        joined = np.flatnonzero(lo[1:] != hi[:-1]) + 1  # where a run of consecutive documents breaks
        lo, hi = lo[np.append(0, joined)], hi[np.append(joined - 1, len(hi) - 1)]
    return np.stack([lo, hi], axis=1).reshape(-1, 2)


def held_out(lengths: np.ndarray, fraction: float) -> np.ndarray:
    """A boolean mask of the documents held out for validation: documents in a seeded order, until they hold
    ``fraction`` of the tokens; one at least when there are two or more, never all."""
    mask = np.zeros(len(lengths), dtype=bool)
    if fraction <= 0 or len(lengths) < 2:
        return mask
    order = np.random.default_rng(SPLIT_SEED).permutation(len(lengths))
    n = int(np.searchsorted(np.cumsum(lengths[order]), fraction * lengths.sum())) + 1
    mask[order[: min(n, len(lengths) - 1)]] = True
    return mask


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a bijective 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def permuted(index: int, n: int, key: int) -> int:
    """``index``'s place in a seeded permutation of ``[0, n)``: a 4-round Feistel network, cycle-walked into range."""
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half, mask = bits // 2, (1 << (bits // 2)) - 1
    keys = [_mix(key * 4 + r) for r in range(4)]
    x = index
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        x = (left << half) | right
        if x < n:
            return x


class SampleStream:
    """Deterministic samples: ``(inputs, targets)`` windows of ``seq_len`` tokens by sample id.

    Args:
        corpus: tokens with ``tokens(start, stop)`` (int64) and ``n_tokens``.
        spans: the ``[k, 2]`` token ranges windows fall in (:func:`segments`).
        seq_len: tokens per sample (a window holds one more, for the shifted targets).
        seed: the permutation of each epoch.
    """

    def __init__(self, corpus, spans: np.ndarray, *, seq_len: int, seed: int):
        self.corpus, self.seq_len, self.seed = corpus, seq_len, seed
        self.spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
        counts = np.maximum(self.spans[:, 1] - self.spans[:, 0] - 1, 0) // seq_len
        self.first_window = np.concatenate([[0], np.cumsum(counts)])
        self.n_windows = int(self.first_window[-1])
        if self.n_windows < 1:
            longest = int((self.spans[:, 1] - self.spans[:, 0]).max()) if len(self.spans) else 0
            raise ValueError(f"no span of the corpus holds train.seq_len+1={seq_len + 1} tokens (the longest holds "
                             f"{longest}): lower train.seq_len, or give more text")

    def window_start(self, sample_id: int) -> int:
        """The first token of sample ``sample_id``'s window."""
        epoch, index = divmod(sample_id, self.n_windows)
        window = permuted(index, self.n_windows, self.seed * 1_000_003 + epoch)
        span = int(np.searchsorted(self.first_window, window, side="right")) - 1
        return int(self.spans[span, 0]) + (window - int(self.first_window[span])) * self.seq_len

    def batch(self, sample_ids: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked ``(inputs, targets)`` of shape ``[len(sample_ids), seq_len]``; targets are inputs shifted by one."""
        windows = np.stack([self.corpus.tokens(s, s + self.seq_len + 1) for s in map(self.window_start, sample_ids)])
        windows = torch.from_numpy(windows)
        return windows[:, :-1], windows[:, 1:]


@dataclass(frozen=True)
class Streams:
    """A run's training samples and, when it holds documents out, its validation samples."""

    train: SampleStream
    val: SampleStream | None
    vocab_size: int
    n_documents: int
    n_val_documents: int


def open_streams(data, *, seq_len: int, seed: int) -> Streams:
    """The training and validation streams of a ``data`` config (:class:`chameleon.config.DataConfig`).

    Raises:
        ValueError: a stream holds no window (the message names the key and the fix).
        chameleon.data.shards.DataError: shards that do not match their manifest.
    """
    corpus = open_corpus(data.path)
    starts = corpus.document_starts()
    everything = lambda c: np.ones(len(c.document_starts()), dtype=bool)  # noqa: E731
    if data.val_path is not None:
        val_corpus = open_corpus(data.val_path)
        train_docs, val_docs = everything(corpus), everything(val_corpus)
    else:
        val_docs = held_out(np.diff(np.append(starts, corpus.n_tokens)), data.val_fraction)
        train_docs, val_corpus = ~val_docs, corpus
    train = SampleStream(corpus, segments(starts, corpus.n_tokens, train_docs, pack=data.pack), seq_len=seq_len,
                         seed=seed)
    val = None
    if val_docs.any():
        spans = segments(val_corpus.document_starts(), val_corpus.n_tokens, val_docs, pack=data.pack)
        try:
            val = SampleStream(val_corpus, spans, seq_len=seq_len, seed=SPLIT_SEED)
        except ValueError as err:
            raise ValueError(f"the validation documents: {err}") from None
    return Streams(train, val, corpus.vocab_size, len(starts), int(val_docs.sum()))


def micro_batch_samples(step: int, micro_batch: int, *, global_batch: int, micro_batch_size: int) -> range:
    """Global sample ids of global micro-batch ``micro_batch`` of ``step``."""
    start = step * global_batch + micro_batch * micro_batch_size
    return range(start, start + micro_batch_size)


def evaluation_due(step: int, *, interval: int, steps: int) -> bool:
    """Whether the validation loss is taken before step ``step`` (``step == steps``: after the last one)."""
    return interval > 0 and 0 < step <= steps and (step % interval == 0 or step == steps)


def sample_ids_digest(per_step_ids: list[list[int]]) -> str:
    """SHA-256 over the sorted sample ids of each step: equal for any layout training the same steps."""
    h = hashlib.sha256()
    for step, ids in enumerate(per_step_ids):
        h.update(f"{step}:{','.join(map(str, sorted(ids)))};".encode())
    return h.hexdigest()
