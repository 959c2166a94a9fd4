"""Token shards on disk: the format, a streaming writer, the integrity check and a reader by window.

A folder written by ``python -m chameleon.prepare`` holds:

* ``shard-00000.bin``, …: raw little-endian token ids (``uint16`` when the vocabulary has at most
  65,536 tokens, else ``uint32``). Every document ends with the EOS id, so document ``i`` of a shard is
  ``[start_i, start_{i+1})`` and a shard always starts and ends on a document boundary.
* ``shard-00000.docs.npy``: the ``int64`` start offset of each of the shard's documents (the first is 0).
* ``manifest.json``: the tokenizer, the totals, every shard and every source file (see :class:`Manifest`).

Shards are written under temporary names and renamed when whole; the manifest is written last, the
same way, and an earlier one is removed before anything else is written. A folder without a manifest
is not a dataset, so an interrupted run never leaves shards that look whole.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FORMAT = "chameleon-tokens/1"
MANIFEST = "manifest.json"
TRAINED_TOKENIZER = "tokenizer.json"  # where a bpe:N tokenizer trained on the sources is saved, beside the shards
SHARD_TOKENS = 1 << 28  # a shard closes before the document that would take it past this many tokens
_TEMP_SUFFIX = ".partial"
_OWN_FILE = re.compile(r"shard-\d{5,}\.(bin|docs\.npy)(\.partial)?|manifest\.json\.partial|tokenizer\.json\.partial")


class DataError(ValueError):
    """Token data, a source or a tokenizer that cannot be used; the message names the key and the fix."""


def dtype_for(vocab_size: int) -> str:
    """The on-disk token type of a vocabulary: ``uint16`` up to 65,536 tokens, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class ShardEntry:
    file: str  # the shard's tokens, relative to the folder
    docs: str  # its document starts
    tokens: int
    documents: int
    max_token_id: int


@dataclass(frozen=True)
class SourceEntry:
    path: str  # absolute
    bytes: int
    sha256: str


@dataclass(frozen=True)
class TokenizerEntry:
    spec: str  # as data.tokenizer resolves it (bytes, bpe:N, or an absolute path)
    fingerprint: str  # sha256 of the tokenizer file (for bpe:N, the tokenizer.json beside the shards), or "bytes"
    eos_token: str  # how the tokenizer spells EOS ("\u0000" for bytes)


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says: the tokenizer, the totals, each shard and each source file."""

    format: str
    source: str  # data.source, absolute
    tokenizer: TokenizerEntry
    vocab_size: int
    eos_id: int
    dtype: str
    text_key: str
    tokens: int
    documents: int
    max_token_id: int
    shards: tuple[ShardEntry, ...]
    sources: tuple[SourceEntry, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, raw: dict) -> Manifest:
        """The manifest a parsed ``manifest.json`` describes.

        Raises:
            KeyError, TypeError, ValueError: a field is missing or of the wrong type.
        """
        ints = ("vocab_size", "eos_id", "tokens", "documents", "max_token_id")
        fields = {k: raw[k] for k in ("format", "source", "dtype", "text_key", *ints)}
        for k in ints:
            if type(fields[k]) is not int:
                raise TypeError(f"{k} is not an integer")
        shards = tuple(ShardEntry(**s) for s in raw["shards"])
        if any(type(getattr(s, k)) is not int for s in shards for k in ("tokens", "documents", "max_token_id")):
            raise TypeError("a shard's counts are not integers")
        return cls(**fields, tokenizer=TokenizerEntry(**raw["tokenizer"]), shards=shards,
                   sources=tuple(SourceEntry(**s) for s in raw["sources"]))

    def rerun(self, directory: Path | str) -> str:
        """The command that writes this folder anew."""
        return (f"rerun python -m chameleon.prepare data.source={self.source} data.tokenizer={self.tokenizer.spec} "
                f"data.path={directory}")


def read_manifest(directory: Path | str) -> Manifest:
    """The manifest of a shard folder.

    Raises:
        DataError: no ``manifest.json``, or one that does not parse as this format.
    """
    path = Path(directory).expanduser() / MANIFEST
    fix = f"run python -m chameleon.prepare data.source=… data.path={directory}"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{directory} holds no {MANIFEST} (it was not prepared, or preparing it was "
                        f"interrupted): {fix}") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path} cannot be read ({err}): {fix}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise DataError(f"{path} is not a {FORMAT} manifest (format {found!r}): {fix}")
    try:
        return Manifest.from_dict(raw)
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"{path} is damaged ({type(err).__name__}: {err}): {fix}") from None


def check_shards(directory: Path | str) -> Manifest:
    """The manifest, once every shard it lists was found whole; cheap enough for every training start.

    Checks that each shard and its document file exist, that each shard holds ``tokens × itemsize`` bytes
    and ends with EOS, that its document starts are ascending, start at 0 and lie inside it, and that
    the manifest's totals add up.

    Raises:
        DataError: one line naming the file and saying to rerun ``python -m chameleon.prepare``.
    """
    folder = Path(directory).expanduser()
    m = read_manifest(folder)
    manifest = folder / MANIFEST

    def refuse(what: str) -> None:
        raise DataError(f"{what}: {m.rerun(directory)}")

    if m.dtype != dtype_for(m.vocab_size):
        refuse(f"{manifest} says dtype {m.dtype} for a vocabulary of {m.vocab_size}")
    if not 0 <= m.eos_id < m.vocab_size or m.max_token_id >= m.vocab_size:
        refuse(f"{manifest} has token ids outside its vocabulary of {m.vocab_size}")
    if not m.shards:
        refuse(f"{manifest} lists no shard")
    itemsize = np.dtype(m.dtype).itemsize
    for s in m.shards:
        file, docs_file = folder / s.file, folder / s.docs
        if not file.is_file() or not docs_file.is_file():
            refuse(f"{file if not file.is_file() else docs_file} is missing")
        size = file.stat().st_size
        if size != s.tokens * itemsize or s.tokens < 1:
            refuse(f"{file} holds {size} bytes, not {s.tokens} tokens × {itemsize} (truncated or replaced)")
        with file.open("rb") as f:
            f.seek(-itemsize, os.SEEK_END)
            last = int(np.frombuffer(f.read(itemsize), dtype=np.dtype(m.dtype).newbyteorder("<"))[0])
        if last != m.eos_id:
            refuse(f"{file} does not end with EOS (id {m.eos_id})")
        try:
            starts = np.load(docs_file, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            refuse(f"{docs_file} cannot be read ({err})")
        if starts.dtype != np.int64 or starts.ndim != 1 or len(starts) != s.documents or s.documents < 1:
            refuse(f"{docs_file} holds {starts.shape} {starts.dtype} starts, not {s.documents} int64 ones")
        if starts[0] != 0 or starts[-1] >= s.tokens or (len(starts) > 1 and not np.all(np.diff(starts) > 0)):
            refuse(f"{docs_file} is not ascending from 0 inside the shard's {s.tokens} tokens")
    for key in ("tokens", "documents"):
        total = sum(getattr(s, key) for s in m.shards)
        if total != getattr(m, key):
            refuse(f"{manifest} says {getattr(m, key)} {key} but its shards add up to {total}")
    if max(s.max_token_id for s in m.shards) != m.max_token_id:
        refuse(f"{manifest}'s max_token_id disagrees with its shards'")
    return m


class TokenShards:
    """A prepared folder, read by window: nothing is held but the shards' open files.

    A window is read with ``pread`` from the page cache, never mapped: a mapped file's touched pages (and
    the kernel's fault-around of 64 KiB each) would count in the worker's resident memory and grow with
    every window read, up to the corpus's size (``docs/data.md`` has the measurement).
    """

    def __init__(self, directory: Path, manifest: Manifest):
        self.directory = directory
        self.manifest = manifest
        self.n_tokens = manifest.tokens
        self.vocab_size = manifest.vocab_size
        self.eos_id = manifest.eos_id
        self._dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self._files = [os.open(directory / s.file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) for s in manifest.shards]
        self._bounds = [0, *itertools.accumulate(s.tokens for s in manifest.shards)]  # shard i: [bounds[i], bounds[i+1])

    @classmethod
    def open(cls, directory: Path | str) -> TokenShards:
        """Check the folder (:func:`check_shards`) and open its shards.

        Raises:
            DataError: the folder is not whole.
        """
        folder = Path(directory).expanduser()
        return cls(folder, check_shards(folder))

    def __len__(self) -> int:
        return self.n_tokens

    def __del__(self) -> None:
        for fd in getattr(self, "_files", ()):
            os.close(fd)

    def __getstate__(self) -> dict:  # a worker opens the files itself
        return {"directory": self.directory, "manifest": self.manifest}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"], state["manifest"])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the shards concatenated in order, as ``int64`` (may span shards).

        Raises:
            IndexError: the range is not inside ``[0, n_tokens]``.
        """
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(f"tokens [{start}, {stop}) are outside [0, {self.n_tokens})")
        parts, at, size = [], start, self._dtype.itemsize
        for i in range(bisect.bisect_right(self._bounds, start) - 1, len(self._files)):
            if at >= stop:
                break
            base, end = self._bounds[i], min(stop, self._bounds[i + 1])
            parts.append(np.frombuffer(os.pread(self._files[i], (end - at) * size, (at - base) * size), self._dtype))
            at = end
        if len(parts) == 1:
            return parts[0].astype(np.int64)
        return np.concatenate(parts, dtype=np.int64) if parts else np.empty(0, dtype=np.int64)

    def document_starts(self) -> np.ndarray:
        """The global start of every document, ascending from 0 (shards concatenated in order), as ``int64``."""
        return np.concatenate([np.load(self.directory / s.docs, allow_pickle=False) + int(base)
                               for s, base in zip(self.manifest.shards, self._bounds)])


class ShardWriter:
    """Streams documents into shards of at most ``shard_tokens`` tokens (a longer document gets a shard alone).

    Each shard is written as ``NAME.partial`` and renamed when closed; :meth:`close` returns the entries
    for the manifest, which the caller writes last (:func:`write_manifest`).
    """

    def __init__(self, directory: Path, *, dtype: str, shard_tokens: int | None = None):
        self.directory = directory
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shard_tokens = shard_tokens or SHARD_TOKENS
        self.entries: list[ShardEntry] = []
        self._file = None
        self._fill = 0
        self._starts: list[np.ndarray] = []
        self._max = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` concatenated, ``lengths`` their sizes (each ≥ 1, EOS included)."""
        ends = np.cumsum(lengths, dtype=np.int64)
        done, at = 0, 0  # documents and tokens of this batch written so far
        while done < len(lengths):
            room = self.shard_tokens - self._fill
            take = int(np.searchsorted(ends, at + room, side="right")) - done
            if take == 0 and self._fill == 0:
                take = 1  # a document longer than a shard
            if take == 0:
                self._close_shard()
                continue
            stop = int(ends[done + take - 1])
            self._write(tokens[at:stop], ends[done:done + take] - lengths[done:done + take] - at)
            done, at = done + take, stop
            if done < len(lengths):
                self._close_shard()

    def _write(self, tokens: np.ndarray, starts: np.ndarray) -> None:
        if self._file is None:
            self._file = open(self._path(len(self.entries), ".bin", _TEMP_SUFFIX), "wb")
        self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._starts.append(starts.astype(np.int64) + self._fill)
        self._fill += len(tokens)
        self._max = max(self._max, int(tokens.max()))

    def _close_shard(self) -> None:
        index = len(self.entries)
        _sync_close(self._file)
        starts = np.concatenate(self._starts)
        f = open(self._path(index, ".docs.npy", _TEMP_SUFFIX), "wb")
        np.save(f, starts, allow_pickle=False)
        _sync_close(f)
        for suffix in (".docs.npy", ".bin"):
            os.replace(self._path(index, suffix, _TEMP_SUFFIX), self._path(index, suffix))
        self.entries.append(ShardEntry(file=self._path(index, ".bin").name, docs=self._path(index, ".docs.npy").name,
                                       tokens=self._fill, documents=len(starts), max_token_id=self._max))
        self._file, self._fill, self._starts, self._max = None, 0, [], 0

    def close(self) -> list[ShardEntry]:
        """Close the last shard; every shard's entry, in order."""
        if self._file is not None:
            self._close_shard()
        return self.entries

    def _path(self, index: int, suffix: str, temp: str = "") -> Path:
        return self.directory / f"shard-{index:05d}{suffix}{temp}"


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically (a temporary file, then a rename); its path."""
    path = directory / MANIFEST
    write_atomic(path, manifest.to_json().encode("utf-8"))
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole, or keeps what it held: written beside it, synced, then renamed."""
    temp = path.with_name(path.name + _TEMP_SUFFIX)
    f = open(temp, "wb")
    f.write(data)
    _sync_close(f)
    os.replace(temp, path)
    _sync_dir(path.parent)


def clear(directory: Path) -> None:
    """Make a folder no dataset before it is written anew: its manifest first, then its shards, temporary
    files and a tokenizer it trained (only files this format writes; anything else stays)."""
    try:
        trained = read_manifest(directory).tokenizer.spec.startswith("bpe:")
    except DataError:
        trained = False
    (directory / MANIFEST).unlink(missing_ok=True)
    _sync_dir(directory)
    for path in directory.iterdir():
        if _OWN_FILE.fullmatch(path.name) or (trained and path.name == TRAINED_TOKENIZER):
            path.unlink()


def _sync_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
