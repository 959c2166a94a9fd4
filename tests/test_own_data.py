"""A user's own corpus end to end: prepared into token shards by each kind of tokenizer, trained through a SIGKILL,
ending at the single-process run's losses, validation losses and samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chameleon.data.stream import load_corpus
from chameleon.report.compare import Drift
from conftest import ENV, SMALL_RUN, TP_PARAMS, assert_nothing_lost, run_entry

VOCAB = 384
JOB = (*SMALL_RUN, "train.eval_interval=3", f"model.vocab_size={VOCAB}")
DP2_PP2 = ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2")


def corpus_jsonl(path: Path) -> Path:
    """Real text as JSONL documents: the bundled poem, 24 lines a document."""
    lines = load_corpus(None).splitlines()
    docs = ["\n".join(lines[i:i + 24]) for i in range(0, len(lines), 24)]
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def prepare(tmp: Path, tokenizer: str) -> Path:
    out = tmp / "shards"
    proc = subprocess.run([sys.executable, "-m", "chameleon.prepare", f"data.source={corpus_jsonl(tmp / 'c.jsonl')}",
                           f"data.tokenizer={tokenizer}", f"data.path={out}"], capture_output=True, text=True, env=ENV,
                          cwd=tmp, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "manifest.json").read_text())["vocab_size"] <= VOCAB
    return out


def trained_tokenizer_json(tmp: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(load_corpus(None).splitlines(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    return path


def trained_sentencepiece(tmp: Path) -> Path:
    import sentencepiece as spm

    text = tmp / "poem.txt"
    text.write_text(load_corpus(None), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp / "sp"), vocab_size=VOCAB,
                                   model_type="bpe", character_coverage=1.0, minloglevel=2)
    return tmp / "sp.model"


def recovered_like_one_process(tmp: Path, shards: Path, *layout: str, data: tuple[str, ...] = (),
                               drift: Drift = Drift()) -> dict:
    job = (*JOB, f"data.path={shards}", *data)
    reference = run_entry("train", tmp / "reference", *job, "launcher.nproc_per_node=1")
    assert reference.returncode == 0, reference.stderr
    run = run_entry("train", tmp / "run", *job, *layout, "failure=kill", "failure.rank=1", "failure.step=4",
                    "failure.phase=forward")
    got = assert_nothing_lost(run, reference, drift=drift)
    assert [r["step"] for r in got["recoveries"]] == [4]
    assert [s for s, _ in got["val_losses"]] == [3, 6]
    return got


def test_a_trained_bpe_corpus_survives_a_kill_with_nothing_lost(tmp_path):
    recovered_like_one_process(tmp_path, prepare(tmp_path, f"bpe:{VOCAB}"), *DP2_PP2)


@pytest.mark.full
def test_a_tokenizer_json_corpus_survives_a_kill_with_nothing_lost(tmp_path):
    recovered_like_one_process(tmp_path, prepare(tmp_path, str(trained_tokenizer_json(tmp_path))), *DP2_PP2)


@pytest.mark.full
def test_a_sentencepiece_corpus_survives_a_kill_with_nothing_lost(tmp_path):
    recovered_like_one_process(tmp_path, prepare(tmp_path, str(trained_sentencepiece(tmp_path))), *DP2_PP2)


@pytest.mark.full
def test_the_same_shards_give_the_same_samples_under_tensor_parallelism(tmp_path):
    recovered_like_one_process(tmp_path, prepare(tmp_path, f"bpe:{VOCAB}"), "launcher.nproc_per_node=4",
                               "parallel.dp=2", "parallel.tp=2", data=("data.pack=document",), drift=TP_PARAMS)


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda out: (out / "shard-00000.bin").write_bytes((out / "shard-00000.bin").read_bytes()[:-10]), "holds"),
    pytest.param(lambda out: (out / "shard-00000.bin").unlink(), "shard-00000.bin", marks=pytest.mark.full),
    pytest.param(lambda out: (out / "manifest.json").write_text("{"), "manifest.json", marks=pytest.mark.full),
], ids=["truncated", "missing", "manifest"])
def test_damaged_shards_are_refused_in_one_line_and_nothing_is_written(tmp_path, damage, expected):
    shards = prepare(tmp_path, "bytes")
    damage(shards)
    run = run_entry("train", tmp_path / "run", *JOB, f"data.path={shards}")
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert f"data.path={shards}" in run.stderr and expected in run.stderr and "chameleon.prepare" in run.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.full
def test_a_vocabulary_larger_than_the_model_is_refused(tmp_path):
    shards = prepare(tmp_path, f"bpe:{VOCAB}")
    run = run_entry("train", tmp_path / "run", *SMALL_RUN, f"data.path={shards}")  # model.vocab_size=256
    assert run.returncode == 2, run.stderr
    vocab = json.loads((shards / "manifest.json").read_text())["vocab_size"]
    assert f"set model.vocab_size={vocab}" in run.stderr and not (tmp_path / "run").exists()
