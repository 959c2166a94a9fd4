"""``python -m chameleon.prepare``: every tokenizer kind against its library applied directly, the shard format,
parallel and repeated runs, interrupted writes, damaged folders and every bad input (one line, exit 2).

Everything is built here from real files in ``tmp_path``: the corpora, a BPE trained by the command, a
``tokenizer.json`` made with ``tokenizers``, a SentencePiece model trained with ``sentencepiece`` and a tiny
tiktoken rank file. Nothing is downloaded.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chameleon import cli
from chameleon.config import ConfigError, DataConfig, typed
from chameleon.data import shards as shards_module
from chameleon.data.shards import DataError, TokenShards, check_shards, read_manifest
from chameleon.data.tokenizer import load_tokenizer, tokenizer_of
from chameleon.prepare import check, prepare
from conftest import ENV

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich — 中文 and emoji 🦎.",
    "",  # an empty document: skipped
    "A line\nand another\n\n  indented, then a tab\there.",
    "Spelled specials stay text: <|endoftext|> </s> <|end_of_text|>",
    "the thing in the ring is thinning " * 5,
]
DOCS = [t for t in TEXTS if t]
# Llama 3's pre-tokenizer split, written out independently of chameleon/data/tokenizer.py.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def write_jsonl(path: Path, texts, key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def run_prepare(source: Path, out: Path, **data) -> TokenShards:
    prepare(DataConfig(source=str(source), path=str(out), **data), log=lambda _: None)
    return TokenShards.open(out)


def documents(shards: TokenShards) -> list[np.ndarray]:
    starts = list(shards.document_starts()) + [shards.n_tokens]
    return [shards.tokens(a, b) for a, b in zip(starts, starts[1:])]


def assert_encoded(shards: TokenShards, texts: list[str], encode, decode=None) -> None:
    """Each document is the oracle's encoding of its text followed by EOS, and nothing else is there."""
    docs = documents(shards)
    assert len(docs) == len(texts) == shards.manifest.documents
    for doc, text in zip(docs, texts):
        assert doc.dtype == np.int64
        assert doc[-1] == shards.eos_id and shards.eos_id not in doc[:-1].tolist()
        assert doc[:-1].tolist() == list(encode(text))
        if decode is not None:
            assert decode(doc[:-1].tolist()) == text
    assert shards.n_tokens == sum(map(len, docs)) == shards.manifest.tokens
    assert shards.document_starts()[0] == 0
    assert shards.manifest.max_token_id == max(int(d.max()) for d in docs) < shards.vocab_size


def test_bytes_from_jsonl(tmp_path):
    shards = run_prepare(write_jsonl(tmp_path / "c.jsonl", TEXTS), tmp_path / "out")
    assert_encoded(shards, DOCS, lambda t: t.encode("utf-8"), lambda ids: bytes(ids).decode("utf-8"))
    m = shards.manifest
    assert (m.format, m.vocab_size, m.eos_id, m.dtype, m.text_key) == ("chameleon-tokens/1", 256, 0, "uint16", "text")
    assert m.tokenizer.spec == m.tokenizer.fingerprint == "bytes"
    assert (tmp_path / "out" / "shard-00000.bin").stat().st_size == 2 * m.tokens
    assert m.sources[0].bytes == (tmp_path / "c.jsonl").stat().st_size and len(m.sources[0].sha256) == 64
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "out").iterdir())
    clone = pickle.loads(pickle.dumps(shards))  # a worker gets the folder, not the tokens
    assert len(pickle.dumps(shards)) < 4096
    assert np.array_equal(clone.tokens(0, len(clone)), shards.tokens(0, len(shards)))


@pytest.mark.full
def test_bpe_trained_on_the_source_through_the_command(tmp_path):
    """bpe:N is trained on the corpus and saved beside the shards; workers=2; a rerun is a no-op (files untouched)."""
    source = write_jsonl(tmp_path / "c.jsonl", TEXTS * 3)
    out = tmp_path / "out"
    first = run_command(tmp_path, f"data.source={source}", f"data.path={out}", "data.tokenizer=bpe:300",
                        "data.workers=2")
    assert first.returncode == 0, first.stderr
    m = read_manifest(out)
    assert first.stdout.splitlines()[-1].startswith(f"{out / 'manifest.json'}: {m.tokens} tokens")
    from tokenizers import Tokenizer

    oracle = Tokenizer.from_file(str(out / "tokenizer.json"))
    oracle.encode_special_tokens = True  # a document's text is text, even where it spells <|endoftext|>
    shards = TokenShards.open(out)
    assert m.eos_id == oracle.token_to_id("<|endoftext|>") and m.vocab_size == oracle.get_vocab_size() == 300
    assert_encoded(shards, DOCS * 3, lambda t: oracle.encode(t, add_special_tokens=False).ids, oracle.decode)
    assert m.tokens < sum(len(t.encode()) + 1 for t in DOCS * 3)  # merges happened
    assert tokenizer_of(out).encode_batch(DOCS) == [oracle.encode(t, add_special_tokens=False).ids for t in DOCS]
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = run_command(tmp_path, f"data.source={source}", f"data.path={out}", "data.tokenizer=bpe:300")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines() == [f"{out / 'manifest.json'}: up to date, {m.tokens} tokens "
                                                 "(same sources and tokenizer; nothing written)"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert not (tmp_path / "outputs").exists() and not list(tmp_path.glob("*.log"))  # no Hydra run dir or log


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A model folder: a BPE tokenizer.json made with ``tokenizers`` and a tokenizer_config.json naming EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    return folder


def hf_oracle(path: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True
    return tok


def test_tokenizer_json_folder_and_file(tmp_path, hf_folder):
    """A model folder takes EOS from tokenizer_config.json; the bare file (another folder) falls back to </s>."""
    source = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    oracle = hf_oracle(hf_folder / "tokenizer.json")
    shards = run_prepare(source, tmp_path / "a", tokenizer=str(hf_folder))
    assert shards.eos_id == oracle.token_to_id("<|im_end|>")
    assert_encoded(shards, DOCS, lambda t: oracle.encode(t, add_special_tokens=False).ids, oracle.decode)
    bare = tmp_path / "bare" / "tok.json"
    bare.parent.mkdir()
    bare.write_bytes((hf_folder / "tokenizer.json").read_bytes())
    shards = run_prepare(source, tmp_path / "b", tokenizer=str(bare))
    assert shards.eos_id == oracle.token_to_id("</s>") and shards.manifest.tokenizer.spec == str(bare)
    shards = run_prepare(source, tmp_path / "c", tokenizer=str(bare), eos_token="<s>")
    assert shards.eos_id == oracle.token_to_id("<s>")
    assert tokenizer_of(tmp_path / "c").eos_id == shards.eos_id  # the folder knows its tokenizer
    bare.write_bytes(bare.read_bytes() + b"\n")
    with pytest.raises(DataError, match="which has changed since"):
        tokenizer_of(tmp_path / "c")


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = ["w69999 w1 w65536", "w65535 w0 nope w12345"]
    shards = run_prepare(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "out", tokenizer=str(tmp_path))
    assert shards.manifest.dtype == "uint32" and shards.vocab_size == 70_002 and shards.eos_id == 70_001
    assert (tmp_path / "out" / "shard-00000.bin").stat().st_size == 4 * shards.n_tokens
    assert_encoded(shards, texts, lambda t: tok.encode(t, add_special_tokens=False).ids)
    assert documents(shards)[0].tolist() == [70_000, 2, 65_537, 70_001]


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "train.txt"
    corpus.write_text("\n".join(["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
                                 "all that glitters is not gold"] * 20))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   hard_vocab_limit=False, minloglevel=2)
    model = tmp_path / "model" / "tokenizer.model"  # Llama 2's name; the content says SentencePiece
    model.parent.mkdir()
    (tmp_path / "sp.model").rename(model)
    oracle = spm.SentencePieceProcessor(model_file=str(model))
    texts = ["the lazy dog saves time", "all that glitters\nis not gold", "a fox"]
    shards = run_prepare(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "out", tokenizer=str(model.parent))
    assert shards.eos_id == oracle.eos_id() and shards.vocab_size == oracle.get_piece_size()
    assert_encoded(shards, texts, lambda t: oracle.encode(t, out_type=int), None)
    assert [oracle.decode(d[:-1].tolist()) for d in documents(shards)] == [" ".join(t.split()) for t in texts]
    tok = load_tokenizer(str(model), eos_token=None)
    assert pickle.loads(pickle.dumps(tok)).encode_batch(texts) == tok.encode_batch(texts)


def tiktoken_file(path: Path) -> dict[bytes, int]:
    """A tiny tiktoken BPE file: every byte, then a few merges, as ``base64 rank`` lines."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b"in", b"ing", b" t", b" the"]
    ranks = {t: r for r, t in enumerate(tokens)}
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def test_tiktoken_file(tmp_path):
    import tiktoken

    model = tmp_path / "tokenizer.model"  # Llama 3's name; the content says tiktoken
    ranks = tiktoken_file(model)
    n = len(ranks)
    oracle = tiktoken.Encoding("oracle", pat_str=LLAMA3_SPLIT, mergeable_ranks=ranks, special_tokens={})
    shards = run_prepare(write_jsonl(tmp_path / "c.jsonl", TEXTS), tmp_path / "out", tokenizer=str(model))
    assert shards.vocab_size == n + 256 and shards.eos_id == n + 1
    assert_encoded(shards, DOCS, oracle.encode_ordinary, oracle.decode)
    assert ranks[b"the"] in documents(shards)[-1] and ranks[b" the"] in documents(shards)[-1]  # merges applied
    tok = load_tokenizer(str(model))
    layout = {"<|begin_of_text|>": n, "<|end_of_text|>": n + 1, "<|reserved_special_token_0|>": n + 2,
              "<|start_header_id|>": n + 6, "<|eot_id|>": n + 9, "<|reserved_special_token_5|>": n + 10,
              "<|reserved_special_token_250|>": n + 255}
    assert {t: tok.token_to_id(t) for t in layout} == layout
    assert pickle.loads(pickle.dumps(tok)).encode_batch(DOCS) == tok.encode_batch(DOCS)


def test_folder_of_txt_jsonl_and_parquet(tmp_path):
    """A folder: supported files, recursively, sorted (others and hidden ones skipped); a .txt is one document."""
    src = tmp_path / "src"
    write_jsonl(src / "a" / "x.jsonl", ["jsonl one", "jsonl two"], key="body")
    (src / "b.txt").write_text("A whole file\n\nis one document.\n")
    pq.write_table(pa.table({"body": ["parquet one", "parquet two"], "n": [1, 2]}), src / "c.parquet")
    (src / "notes.md").write_text("skipped")
    write_jsonl(src / ".hidden" / "y.jsonl", ["hidden"], key="body")
    shards = run_prepare(src, tmp_path / "out", text_key="body")
    texts = ["jsonl one", "jsonl two", "A whole file\n\nis one document.\n", "parquet one", "parquet two"]
    assert_encoded(shards, texts, lambda t: t.encode(), lambda ids: bytes(ids).decode())
    assert [Path(s.path).name for s in shards.manifest.sources] == ["x.jsonl", "b.txt", "c.parquet"]
    single = run_prepare(src / "b.txt", tmp_path / "txt")
    assert single.manifest.documents == 1 and single.manifest.text_key == "text"


def test_shards_split_on_document_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(shards_module, "SHARD_TOKENS", 64)
    texts = [f"document {i} " + "x" * (i * 7 % 50) for i in range(40)] + ["y" * 200]  # the last outgrows a shard
    shards = run_prepare(write_jsonl(tmp_path / "c.jsonl", texts), tmp_path / "out")
    m = shards.manifest
    assert len(m.shards) > 5 and all(s.tokens <= 64 for s in m.shards[:-1]) and m.shards[-1].tokens == 201
    for s in m.shards:
        starts = np.load(tmp_path / "out" / s.docs)
        assert starts[0] == 0 and len(starts) == s.documents
    assert_encoded(shards, texts, lambda t: t.encode())
    whole = np.concatenate([np.frombuffer(t.encode(), np.uint8).astype(np.int64).tolist() + [0] for t in texts])
    for a, b in [(0, shards.n_tokens), (60, 70), (63, 64), (64, 64), (10, 300), (shards.n_tokens - 1, shards.n_tokens)]:
        assert np.array_equal(shards.tokens(a, b), whole[a:b])
    with pytest.raises(IndexError):
        shards.tokens(0, shards.n_tokens + 1)


def test_two_workers_write_the_same_bytes_as_one(tmp_path, monkeypatch, hf_folder):
    monkeypatch.setattr(shards_module, "SHARD_TOKENS", 256)
    src = tmp_path / "src"
    for i in range(3):
        write_jsonl(src / f"part{i}.jsonl", [f"part {i} doc {j}: " + TEXTS[j % len(TEXTS)] for j in range(30)])
    for workers in (1, 2):
        run_prepare(src, tmp_path / f"w{workers}", tokenizer=str(hf_folder), workers=workers)
    one, two = (sorted(p.name for p in (tmp_path / f"w{w}").iterdir()) for w in (1, 2))
    assert one == two and len([n for n in one if n.endswith(".bin")]) > 2
    for name in one:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_rerun_is_a_noop_until_a_source_or_the_tokenizer_changes(tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    out = tmp_path / "out"
    data = DataConfig(source=str(source), path=str(out))
    assert prepare(data, log=lambda _: None).written
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = prepare(data, log=lambda _: None)
    assert not again.written and "up to date" in again.line()
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    write_jsonl(source, TEXTS[:2])
    assert prepare(data, log=lambda _: None).written and read_manifest(out).documents == 2
    tiktoken_file(tmp_path / "tok.model")
    assert prepare(DataConfig(source=str(source), path=str(out), tokenizer=str(tmp_path / "tok.model")),
                   log=lambda _: None).written
    assert read_manifest(out).eos_id == 264


KILL_MID_SHARD = """
import os, signal, sys
from chameleon.data import shards
shards.SHARD_TOKENS = 64
write = shards.ShardWriter._write
def write_then_die(self, tokens, starts):  # SIGKILL while the third shard is half written
    write(self, tokens, starts)
    if len(self.entries) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
shards.ShardWriter._write = write_then_die
from chameleon import prepare
prepare.main()
"""


def test_an_interrupted_write_leaves_no_folder_that_passes(tmp_path):
    """Killed mid-shard: no manifest, so check_shards refuses — also over a whole folder from an earlier run."""
    out = tmp_path / "out"
    (tmp_path / "tmp").mkdir()  # where the killed run leaves datasets' cache
    run_prepare(write_jsonl(tmp_path / "old.jsonl", ["an earlier corpus"]), out)
    source = write_jsonl(tmp_path / "c.jsonl", [f"document {i} " + "z" * 30 for i in range(20)])
    killed = subprocess.run([sys.executable, "-c", KILL_MID_SHARD, f"data.source={source}", f"data.path={out}"],
                            capture_output=True, text=True, env={**ENV, "TMPDIR": str(tmp_path / "tmp")},
                            cwd=tmp_path, timeout=120)
    assert killed.returncode == -9, killed.stderr
    names = sorted(p.name for p in out.iterdir())
    assert "shard-00002.bin.partial" in names and "shard-00001.bin" in names and "manifest.json" not in names
    with pytest.raises(DataError, match="holds no manifest.json"):
        check_shards(out)
    with pytest.raises(DataError):
        TokenShards.open(out)
    shards = run_prepare(source, out)  # a rerun finishes the job and sweeps the debris
    assert shards.manifest.documents == 20 and not any(n.endswith(".partial") for n in os.listdir(out))


@pytest.fixture
def prepared(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(shards_module, "SHARD_TOKENS", 64)
    out = tmp_path / "out"
    run_prepare(write_jsonl(tmp_path / "c.jsonl", [f"doc {i} " + "q" * 20 for i in range(12)]), out)
    return out


def edit_manifest(out: Path, edit) -> None:
    raw = json.loads((out / "manifest.json").read_text())
    edit(raw)
    (out / "manifest.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda out: os.truncate(out / "shard-00001.bin", (out / "shard-00001.bin").stat().st_size - 2),
     "shard-00001.bin holds"),
    (lambda out: (out / "shard-00002.bin").unlink(), "shard-00002.bin is missing"),
    (lambda out: (out / "shard-00000.docs.npy").unlink(), "shard-00000.docs.npy is missing"),
    (lambda out: edit_manifest(out, lambda m: m.update(tokens=m["tokens"] + 1)), "but its shards add up to"),
    (lambda out: edit_manifest(out, lambda m: m["shards"][0].update(tokens=m["shards"][0]["tokens"] - 1)),
     "shard-00000.bin holds"),
    (lambda out: edit_manifest(out, lambda m: m["shards"][1].update(documents=1)), "shard-00001.docs.npy holds"),
    (lambda out: np.save(out / "shard-00000.docs.npy", np.load(out / "shard-00000.docs.npy")[::-1].copy()),
     "not ascending"),
    (lambda out: (out / "manifest.json").write_text("{"), "manifest.json cannot be read"),
    (lambda out: edit_manifest(out, lambda m: m.pop("shards")), "manifest.json is damaged"),
], ids=["truncated", "missing shard", "missing docs", "total tokens", "shard tokens", "documents", "docs order",
        "not json", "no shards key"])
def test_check_shards_refuses_a_damaged_folder(prepared, damage, expected):
    assert len(check_shards(prepared).shards) >= 3
    damage(prepared)
    with pytest.raises(DataError, match="rerun python -m chameleon.prepare|run python -m chameleon.prepare") as err:
        TokenShards.open(prepared)
    assert expected in str(err.value) and "\n" not in str(err.value)


def run_command(cwd: Path, *overrides: str, popen: bool = False):
    cmd = [sys.executable, "-m", "chameleon.prepare", "output.progress=false", *overrides]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd)
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=120)


def bad_inputs(tmp: Path) -> tuple[dict, dict]:
    """Bad inputs, as overrides and what their one line must say: those the command itself is run on, and
    those whose refusal is checked in-process (the command's own check and prepare, as it runs them)."""
    good = write_jsonl(tmp / "good.jsonl", TEXTS)
    missing_field = tmp / "missing.jsonl"
    missing_field.write_text('{"text": "a"}\n\n{"body": "b"}\n')
    invalid = tmp / "invalid.jsonl"
    invalid.write_text('{"text": "a"}\n{"text": "b"\n{"text": "c"}\n')
    (tmp / "empty.txt").write_text("")
    no_text = write_jsonl(tmp / "blank.jsonl", ["", ""])
    (tmp / "c.csv").write_text("text\nhello\n")
    (tmp / "garbage.model").write_bytes(bytes(range(256)) * 4)
    (tmp / "broken.json").write_text('{"model": ')
    (tmp / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    pq.write_table(pa.table({"body": ["x"]}), tmp / "other.parquet")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(tmp / "no_eos.json"))
    at = [f"data.path={tmp / 'out'}"]
    command = {
        "no arguments": ([], "data.source= and data.path= are needed"),
        "no data.path": ([f"data.source={good}"], "data.path= is needed"),
        "source missing": ([f"data.source={tmp / 'nope.jsonl'}", *at], "does not exist"),
        "empty source": ([f"data.source={tmp / 'empty.txt'}", *at], "holds no text"),
        "unsupported extension": ([f"data.source={tmp / 'c.csv'}", *at], ".csv is not supported"),
        "line without the field": ([f"data.source={missing_field}", *at], f"{missing_field} line 3 has no field 'text'"),
        "invalid JSON": ([f"data.source={invalid}", *at], f"{invalid} line 2 is not valid JSON"),
        "tokenizer that does not parse": ([f"data.source={good}", *at, f"data.tokenizer={tmp / 'garbage.model'}"],
                                          f"data.tokenizer={tmp / 'garbage.model'} is not a tokenizer file that parses"),
        "no EOS known": ([f"data.source={good}", *at, f"data.tokenizer={tmp / 'no_eos.json'}"], "set data.eos_token="),
    }
    in_process = {
        "no text in any line": ([f"data.source={no_text}", *at], "holds no text"),
        "not UTF-8": ([f"data.source={tmp / 'latin1.txt'}", *at], "latin1.txt is not UTF-8 text (byte 3)"),
        "parquet without the column": ([f"data.source={tmp / 'other.parquet'}", *at], "has no column 'text'"),
        "broken tokenizer.json": ([f"data.source={good}", *at, f"data.tokenizer={tmp / 'broken.json'}"],
                                  "is not a tokenizer.json"),
        "EOS not a token": ([f"data.source={good}", *at, f"data.tokenizer={tmp / 'no_eos.json'}", "data.eos_token='</s>'"],
                            "data.eos_token='</s>' is not a token"),
        "EOS with bytes": ([f"data.source={good}", *at, "data.eos_token=x"], "does not apply to data.tokenizer=bytes"),
        "bad bpe:N": ([f"data.source={good}", *at, "data.tokenizer=bpe:lots"], "N must be a whole number"),
        "no such tokenizer": ([f"data.source={good}", *at, "data.tokenizer=llama.model"], "data.tokenizer=llama.model is not"),
        "workers": ([f"data.source={good}", *at, "data.workers=0"], "data.workers=0"),
        "output inside the source": ([f"data.source={tmp}", f"data.path={tmp / 'shards'}"], "lies inside data.source"),
        "output is a file": ([f"data.source={good}", f"data.path={good}"], "is a file"),
    }
    return command, in_process


@pytest.mark.full  # 20 commands, 21 s: the full suite's (the fast tier stays under 5 minutes)
def test_every_bad_input_is_one_line_and_exit_2(tmp_path):
    command, in_process = bad_inputs(tmp_path)
    procs = {name: run_command(tmp_path, *overrides, popen=True) for name, (overrides, _) in command.items()}
    for name, (overrides, expected) in in_process.items():
        cfg = cli.compose_command_line(overrides)
        with pytest.raises((ConfigError, DataError)) as err:
            check(cfg)
            prepare(typed(cfg, "data", DataConfig), log=lambda _: None)
        assert expected in cli.one_line(err.value) and "\n" not in str(err.value), (name, str(err.value))
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert proc.returncode == 2, (name, err)
        assert len(lines) == 1 and lines[0].startswith("chameleon: config error: "), (name, err)
        assert command[name][1] in lines[0], (name, lines[0])
        assert out == "", (name, out)
    assert not (tmp_path / "out").exists() and not (tmp_path / "shards").exists()
    assert not (tmp_path / "outputs").exists()


def test_help_names_the_keys():
    proc = subprocess.run([sys.executable, "-m", "chameleon.prepare", "--help"], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "data.source=PATH data.path=DIR" in proc.stdout and "bpe:N" in proc.stdout
