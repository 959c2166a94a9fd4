"""The global sample stream: deterministic, layout-independent, real text."""

from __future__ import annotations

import pytest
import torch

import numpy as np

from chameleon.config import DataConfig
from chameleon.data.stream import (
    ByteText, SampleStream, decode, encode, evaluation_due, held_out, load_corpus, micro_batch_samples, open_streams,
    permuted, sample_ids_digest, segments,
)
from chameleon.layout.plan import even_plan, micro_batch_ranges


class Tokens:
    """An in-memory corpus: token ``i`` is ``i`` (a window's first token says where it starts)."""

    def __init__(self, n: int):
        self.n_tokens, self.ids = n, np.arange(n, dtype=np.int64)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self.ids[start:stop]


def bundled(seq_len: int, seed: int) -> SampleStream:
    return open_streams(DataConfig(), seq_len=seq_len, seed=seed).train


def test_bundled_corpus_is_real_text():
    text = load_corpus(None)
    assert len(text) > 400_000 and "EDEN" in text
    assert decode(encode(text[:1000])) == text[:1000]


def test_samples_are_deterministic_and_shifted(tmp_path):
    stream = bundled(32, 3)
    x, y = stream.batch(range(5, 9))
    x2, y2 = bundled(32, 3).batch([5, 6, 7, 8])
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    other, _ = bundled(32, 4).batch(range(5, 9))
    assert not torch.equal(x, other)


def test_epochs_cover_every_window_once():
    stream = SampleStream(Tokens(1001), np.array([[0, 1001]]), seq_len=10, seed=0)
    x, _ = stream.batch(range(stream.n_windows))
    assert sorted(x[:, 0].tolist()) == list(range(0, 1000, 10))
    second, _ = stream.batch(range(stream.n_windows, 2 * stream.n_windows))
    assert sorted(second[:, 0].tolist()) == list(range(0, 1000, 10)) and not torch.equal(second, x)  # reshuffled


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4099])
def test_the_permutation_is_a_bijection_of_every_size(n):
    for key in (0, 1, 12345):
        assert sorted(permuted(i, n, key) for i in range(n)) == list(range(n))


def test_windows_stay_inside_their_segments():
    # documents [0,10) [10,40) [40,45) [45,100); the second and fourth are chosen
    starts, chosen = np.array([0, 10, 40, 45]), np.array([False, True, False, True])
    assert segments(starts, 100, chosen, pack="document").tolist() == [[10, 40], [45, 100]]
    assert segments(starts, 100, np.array([True, True, False, True]), pack="window").tolist() == [[0, 40], [45, 100]]
    stream = SampleStream(Tokens(100), segments(starts, 100, chosen, pack="document"), seq_len=8, seed=1)
    assert stream.n_windows == (30 - 1) // 8 + (55 - 1) // 8
    x, y = stream.batch(range(stream.n_windows))
    for inputs, targets in zip(x.tolist(), y.tolist()):
        first, last = inputs[0], targets[-1]
        assert (10 <= first and last < 40) or (45 <= first and last < 100)  # never across a document boundary


def test_validation_documents_are_held_out_by_tokens_and_never_all():
    lengths = np.array([100] * 40)
    mask = held_out(lengths, 0.1)
    assert mask.sum() == 4 and held_out(lengths, 0.1).tolist() == mask.tolist()  # seeded: the same every time
    assert held_out(np.array([5, 5]), 0.9).sum() == 1 and held_out(np.array([50]), 0.5).sum() == 0
    assert held_out(lengths, 0.0).sum() == 0


def test_training_never_sees_a_validation_window():
    streams = open_streams(DataConfig(), seq_len=64, seed=0)
    text = load_corpus(None).encode()
    train = {streams.train.window_start(i) for i in range(streams.train.n_windows)}
    val = {streams.val.window_start(i) for i in range(streams.val.n_windows)}
    assert streams.n_val_documents >= 1 and streams.val.n_windows * 64 >= 0.04 * len(text)
    reach = lambda starts: {t for s in starts for t in range(s, s + 65)}  # noqa: E731
    assert not reach(train) & reach(val)


def test_paragraphs_are_the_documents_of_a_text():
    corpus = ByteText("one\ntwo\n\nthree\n \n\nfour")
    assert corpus.document_starts().tolist() == [0, 9, 18]
    assert bytes(corpus.tokens(18, 22).astype(np.uint8)) == b"four"


def test_validation_is_taken_on_schedule_and_after_the_last_step():
    due = [k for k in range(0, 12) if evaluation_due(k, interval=4, steps=10)]
    assert due == [4, 8, 10]
    assert not any(evaluation_due(k, interval=0, steps=10) for k in range(12))


def test_user_text_file(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("hello world " * 50)
    x, _ = open_streams(DataConfig(path=str(path)), seq_len=8, seed=0).train.batch([0])
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


def test_validation_shards_of_their_own(tmp_path):
    train_text, val_text = tmp_path / "train.txt", tmp_path / "val.txt"
    train_text.write_text("alpha beta gamma delta " * 40 + "\n\n" + "epsilon zeta eta " * 40)
    val_text.write_text("held out words only " * 30)
    streams = open_streams(DataConfig(path=str(train_text), val_path=str(val_text)), seq_len=16, seed=0)
    assert streams.n_documents == 2 and streams.n_val_documents == 1  # every training document trains
    val, _ = streams.val.batch(range(streams.val.n_windows))
    assert all(decode(row) in "held out words only " * 30 for row in val)
    assert streams.train.n_windows == (922 + 680 - 1) // 16  # both paragraphs, one run of windows
