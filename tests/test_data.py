"""The global sample stream: deterministic, layout-independent, real text."""

from __future__ import annotations

import pytest
import torch

from chameleon.data.stream import SampleStream, decode, encode, load_corpus, micro_batch_samples, sample_ids_digest
from chameleon.layout.plan import even_plan, micro_batch_ranges


def test_bundled_corpus_is_real_text():
    text = load_corpus(None)
    assert len(text) > 400_000 and "EDEN" in text
    assert decode(encode(text[:1000])) == text[:1000]


def test_samples_are_deterministic_and_shifted(tmp_path):
    stream = SampleStream.from_config(path=None, seq_len=32, seed=3)
    x, y = stream.batch(range(5, 9))
    x2, y2 = SampleStream.from_config(path=None, seq_len=32, seed=3).batch([5, 6, 7, 8])
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    other, _ = SampleStream.from_config(path=None, seq_len=32, seed=4).batch(range(5, 9))
    assert not torch.equal(x, other)


def test_epochs_cover_every_window_once():
    stream = SampleStream(torch.arange(1001), seq_len=10, seed=0)
    x, _ = stream.batch(range(stream.n_windows))
    assert sorted(x[:, 0].tolist()) == list(range(0, 1000, 10))


def test_user_text_file(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("hello world " * 50)
    x, _ = SampleStream.from_config(path=str(path), seq_len=8, seed=0).batch([0])
    assert decode(x[0]) in ("hello world " * 50)
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_corpus(str(tmp_path / "missing.txt"))


def test_step_samples_do_not_depend_on_layout():
    def trained(dp: int) -> list[int]:
        plan = even_plan(dp=dp, pp=1, tp=1, n_layers=4, global_batch=16, micro_batch=2)
        return sorted(
            i
            for r in micro_batch_ranges(plan)
            for m in r
            for i in micro_batch_samples(3, m, global_batch=16, micro_batch_size=2)
        )

    assert trained(1) == trained(2) == trained(4) == list(range(48, 64))
    assert sample_ids_digest([trained(1)]) == sample_ids_digest([trained(4)])
