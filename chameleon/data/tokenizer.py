"""The tokenizers ``data.tokenizer`` names: UTF-8 bytes, a BPE trained on the corpus, or a local tokenizer file.

* ``bytes``: UTF-8 bytes, vocabulary 256. EOS is id 0, the NUL byte, which text does not hold (a NUL
  character inside a document is dropped, so id 0 only ever ends a document).
* ``bpe:N``: a byte-level BPE of N tokens trained on the source texts with Hugging Face ``tokenizers``;
  EOS is the special token ``<|endoftext|>`` (or ``data.eos_token``). It is saved as ``tokenizer.json``
  beside the shards, so they carry their tokenizer.
* a path: a ``tokenizer.json`` (or a model folder holding one, the folder ``model.init=hf:PATH`` reads, or
  else its ``tokenizer.model``), a SentencePiece model (Llama 2's ``tokenizer.model``) or a tiktoken BPE
  file (Llama 3's ``tokenizer.model``); the file's content tells which, not its name.

Nothing is ever downloaded. Documents are encoded as plain text: no BOS or other special token is added,
and text that spells a special token (``<|endoftext|>``) is encoded as that text, never as the token.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chameleon.data.shards import TRAINED_TOKENIZER, DataError, write_atomic

BPE_EOS = "<|endoftext|>"
# The end-of-document tokens looked for in a tokenizer.json whose tokenizer_config.json names none.
KNOWN_EOS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
# How Llama 3 splits text before BPE merges, and its 256 special tokens after the base ranks.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_EOS = "<|end_of_text|>"
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+\r?")
_SPECS = "bytes, bpe:N, or a tokenizer.json, model folder, SentencePiece or tiktoken model file"


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order (the first gets the id after the last base rank)."""
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>",
             9: "<|eot_id|>"}
    tokens, reserved = [], 0
    for i in range(256):
        if i in named:
            tokens.append(named[i])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tokens


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: what the manifest records about it, and batch encoding."""

    spec: str  # bytes | bpe:N | the tokenizer file's absolute path
    name: str  # bytes | huggingface | sentencepiece | tiktoken
    vocab_size: int
    eos_id: int
    eos_token: str
    fingerprint: str  # sha256 of the tokenizer file, or "bytes"
    _codec: object = field(repr=False, compare=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, no special token added (EOS is the caller's to append)."""
        return self._codec.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._codec.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        """The id of a token (special or not) spelled as the tokenizer spells it; None if it has none."""
        return self._codec.token_to_id(token)


def parse_spec(spec: str) -> tuple[str, int | Path | None]:
    """What ``data.tokenizer`` names, checked without reading a file: ``("bytes", None)``, ``("bpe", N)``
    or ``("file", PATH)`` (a folder resolved to its ``tokenizer.json``, else its ``tokenizer.model``).

    Raises:
        DataError: a malformed ``bpe:N``, or a path that does not exist.
    """
    if spec == "bytes":
        return "bytes", None
    if spec.startswith("bpe:"):
        n = spec[4:]
        if not n.isdigit() or int(n) < 257:
            raise DataError(f"data.tokenizer={spec}: N must be a whole number ≥ 257 (256 bytes and EOS), "
                            "e.g. data.tokenizer=bpe:32000")
        return "bpe", int(n)
    path = Path(spec).expanduser()
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return "file", (path / name).resolve()
        raise DataError(f"data.tokenizer={spec} is a folder without tokenizer.json or tokenizer.model: "
                        "give the tokenizer file itself, or a model folder holding one")
    if not path.is_file():
        raise DataError(f"data.tokenizer={spec} is not {_SPECS} (no such file): give one of those")
    return "file", path.resolve()


def load_tokenizer(spec: str, *, eos_token: str | None = None, train_on: Iterable[str] | None = None,
                   save_to: Path | None = None) -> Tokenizer:
    """The tokenizer ``data.tokenizer=spec`` names, with its end-of-document token.

    Args:
        spec: ``bytes``, ``bpe:N``, or a tokenizer file or model folder (see the module's docstring).
        eos_token: ``data.eos_token``, the token that ends each document; None: the tokenizer's own.
        train_on: the texts a ``bpe:N`` tokenizer is trained on (needed for ``bpe:N``, unused otherwise).
        save_to: the folder a trained tokenizer is saved to, as ``tokenizer.json`` (``bpe:N`` only).

    Raises:
        DataError: one line naming ``data.tokenizer=`` (or ``data.eos_token=``) and the fix.
    """
    kind, arg = parse_spec(spec)
    if kind == "bytes":
        if eos_token is not None:
            raise DataError(f"data.eos_token={eos_token!r} does not apply to data.tokenizer=bytes, whose EOS is "
                            "byte 0: drop data.eos_token, or pick another tokenizer")
        return Tokenizer("bytes", "bytes", 256, 0, "\0", "bytes", _Bytes())
    if kind == "bpe":
        if train_on is None:
            raise DataError(f"data.tokenizer={spec} is trained on the source texts, and none were given")
        text = _train_bpe(arg, train_on, eos_token or BPE_EOS)
        data = text.encode("utf-8")
        if save_to is not None:
            Path(save_to).mkdir(parents=True, exist_ok=True)
            write_atomic(Path(save_to) / TRAINED_TOKENIZER, data)
        return _huggingface(spec, text, data, eos_token or BPE_EOS)
    return _from_file(spec, arg, eos_token)


def tokenizer_of(directory: Path | str) -> Tokenizer:
    """The tokenizer a prepared folder was written with (for ``bpe:N``, the ``tokenizer.json`` beside its shards).

    Raises:
        DataError: the folder has no manifest, or the tokenizer file is gone or no longer the one it names.
    """
    from chameleon.data.shards import read_manifest

    folder = Path(directory).expanduser()
    entry = read_manifest(folder).tokenizer
    spec = str(folder / TRAINED_TOKENIZER) if entry.spec.startswith("bpe:") else entry.spec
    fix = f"rerun python -m chameleon.prepare for data.path={directory}"
    try:
        tok = load_tokenizer(spec, eos_token=None if spec == "bytes" else entry.eos_token)
    except DataError as err:
        raise DataError(f"{directory} was written with tokenizer {spec}, which no longer loads ({err}): "
                        f"{fix}") from None
    if tok.fingerprint != entry.fingerprint:
        raise DataError(f"{directory} was written with tokenizer {spec}, which has changed since "
                        f"(sha256 {tok.fingerprint[:12]}…, not {entry.fingerprint[:12]}…): {fix}")
    return tok


def fingerprint(data: bytes) -> str:
    """sha256 of a tokenizer file's content."""
    return hashlib.sha256(data).hexdigest()


def _from_file(spec: str, path: Path, eos_token: str | None) -> Tokenizer:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"data.tokenizer={spec} cannot be read ({err.strerror}): give a readable file") from None
    if data.lstrip()[:1] == b"{":
        return _tokenizer_json(spec, path, data, eos_token)
    if _TIKTOKEN_LINE.fullmatch(data[:4096].split(b"\n", 1)[0]):
        return _tiktoken(spec, path, data, eos_token)
    return _sentencepiece(spec, path, data, eos_token)


def _tokenizer_json(spec: str, path: Path, data: bytes, eos_token: str | None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    text = data.decode("utf-8", errors="replace")
    try:
        probe = HFTokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise DataError(f"data.tokenizer={spec} is not a tokenizer.json Hugging Face tokenizers can read "
                        f"({_first_line(err)}): give a valid tokenizer.json, or {_SPECS}") from None
    if eos_token is None:
        eos_token = _configured_eos(spec, path)
    if eos_token is None:
        eos_token = next((t for t in KNOWN_EOS if probe.token_to_id(t) is not None), None)
    if eos_token is None:
        raise DataError(f"data.tokenizer={spec} names no end-of-document token (tokenizer_config.json beside it "
                        f"has no eos_token and it has none of {', '.join(KNOWN_EOS)}): set data.eos_token= to one of "
                        "its tokens")
    return _huggingface(str(path), text, data, eos_token)


def _configured_eos(spec: str, path: Path) -> str | None:
    """``eos_token`` of the ``tokenizer_config.json`` beside a tokenizer.json."""
    config = path.parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_bytes()).get("eos_token")
    except (ValueError, AttributeError):
        raise DataError(f"data.tokenizer={spec}: {config} is not a JSON object: fix it, or set "
                        "data.eos_token=") from None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def _huggingface(spec: str, text: str, data: bytes, eos_token: str) -> Tokenizer:
    codec = _HuggingFace(text)
    eos_id = codec.token_to_id(eos_token)
    if eos_id is None:
        raise DataError(f"data.eos_token={eos_token!r} is not a token of data.tokenizer={spec}: "
                        "set data.eos_token= to one of its tokens")
    vocab_size = max(codec.tok.get_vocab(with_added_tokens=True).values()) + 1
    return Tokenizer(spec, "huggingface", vocab_size, eos_id, eos_token, fingerprint(data), codec)


def _train_bpe(n: int, texts: Iterable[str], eos_token: str) -> str:
    """A byte-level BPE of ``n`` tokens trained on ``texts``, as tokenizer.json text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n, special_tokens=[eos_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok.to_str(pretty=True)


def _tiktoken(spec: str, path: Path, data: bytes, eos_token: str | None) -> Tokenizer:
    import tiktoken

    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise DataError(f"data.tokenizer={spec}: line {number} is not 'BASE64TOKEN RANK', as a tiktoken BPE file's "
                            "lines are: give an intact file") from None
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))) or any(bytes([b]) not in ranks for b in range(256)):
        raise DataError(f"data.tokenizer={spec}: its ranks are not 0…{len(ranks) - 1} once each over every single "
                        "byte, as a tiktoken BPE file's are: give an intact file")
    specials = {t: len(ranks) + i for i, t in enumerate(llama3_special_tokens())}
    eos_token = eos_token or LLAMA3_EOS
    if eos_token not in specials:
        raise DataError(f"data.eos_token={eos_token!r} is not one of the special tokens of data.tokenizer={spec}: "
                        f"use {LLAMA3_EOS} (the default) or another of Llama 3's special tokens")
    encoding = tiktoken.Encoding(path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    return Tokenizer(str(path), "tiktoken", encoding.n_vocab, specials[eos_token], eos_token, fingerprint(data),
                     _Tiktoken(encoding))


def _sentencepiece(spec: str, path: Path, data: bytes, eos_token: str | None) -> Tokenizer:
    import sentencepiece

    try:
        sp = sentencepiece.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, OSError, TypeError) as err:
        raise DataError(f"data.tokenizer={spec} is not a tokenizer file that parses ({_first_line(err)}): give "
                        f"{_SPECS}") from None
    if eos_token is None:
        eos_id = sp.eos_id()
        if eos_id < 0:
            raise DataError(f"data.tokenizer={spec} is a SentencePiece model without an EOS piece: "
                            "set data.eos_token= to one of its pieces")
        eos_token = sp.id_to_piece(eos_id)
    else:
        eos_id = sp.piece_to_id(eos_token)
        if sp.id_to_piece(eos_id) != eos_token:
            raise DataError(f"data.eos_token={eos_token!r} is not a piece of data.tokenizer={spec}: "
                            "set data.eos_token= to one of its pieces")
    return Tokenizer(str(path), "sentencepiece", sp.get_piece_size(), eos_id, eos_token, fingerprint(data),
                     _SentencePiece(data))


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class _Bytes:
    def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(t.replace("\0", "").encode("utf-8", errors="replace")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        raw = token.encode("utf-8")
        return raw[0] if len(raw) == 1 else None


class _HuggingFace:
    """A ``tokenizers.Tokenizer`` that encodes special tokens' spellings as text; pickled as its JSON."""

    def __init__(self, text: str):
        from tokenizers import Tokenizer as HFTokenizer

        self.text = text
        self.tok = HFTokenizer.from_str(text)
        self.tok.encode_special_tokens = True

    def __getstate__(self) -> str:
        return self.text

    def __setstate__(self, text: str) -> None:
        self.__init__(text)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


class _SentencePiece:
    def __init__(self, proto: bytes):
        import sentencepiece

        self.proto = proto
        self.sp = sentencepiece.SentencePieceProcessor(model_proto=proto)

    def __getstate__(self) -> bytes:
        return self.proto

    def __setstate__(self, proto: bytes) -> None:
        self.__init__(proto)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None


class _Tiktoken:
    def __init__(self, encoding):
        self.encoding = encoding

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        for spelling in (token, token.encode("utf-8")):
            with contextlib.suppress(KeyError):  # not a token under this spelling: try the next
                return self.encoding.encode_single_token(spelling)
        return None
