"""The corpus ``data.source`` names, read with Hugging Face ``datasets``: listed, hashed, loaded, tokenized.

A source is one file or a folder: every ``.txt``, ``.jsonl``, ``.json`` and ``.parquet`` file in it,
recursively, sorted by path (other files, and hidden files and folders, are skipped). A ``.txt`` file is
one document, the whole file; a ``.jsonl`` or ``.json`` file holds one document per line, its field
``data.text_key``; a ``.parquet`` file one per row, column ``data.text_key`` (a ``.json`` file holding one JSON array of objects works too).
Documents whose text encodes to no token are skipped.
``datasets`` keeps its Arrow files in the cache folder the caller gives (memory-mapped, not in RAM).
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from chameleon.data.shards import DataError, SourceEntry

LOADERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_KINDS = "a .txt, .jsonl, .json or .parquet file, or a folder of them"


def list_sources(source: str) -> list[Path]:
    """The files ``data.source`` names, absolute, in order.

    Raises:
        DataError: the source is missing, of an unsupported kind, holds no supported file, or only empty files.
    """
    path = Path(source).expanduser().resolve()
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.suffix.lower() in LOADERS and p.is_file()
                        and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise DataError(f"data.source={source} holds no .txt, .jsonl, .json or .parquet file: give {_KINDS}")
    elif path.is_file():
        if path.suffix.lower() not in LOADERS:
            raise DataError(f"data.source={source}: {path.suffix or 'a file without an extension'} is not supported: "
                            f"give {_KINDS}")
        files = [path]
    else:
        raise DataError(f"data.source={source} does not exist: give {_KINDS}")
    if all(f.stat().st_size == 0 for f in files):
        raise DataError(f"data.source={source} holds no text (every file is empty): give files with text")
    return files


def describe_sources(files: list[Path]) -> list[SourceEntry]:
    """Each file's path, size and sha256 (what tells a rerun whether anything changed)."""
    entries = []
    for file in files:
        h = hashlib.sha256()
        with file.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        entries.append(SourceEntry(path=str(file), bytes=file.stat().st_size, sha256=h.hexdigest()))
    return entries


def load_texts(files: list[Path], *, text_key: str, cache_dir: Path, workers: int = 1):
    """The documents of ``files`` in order, as a ``datasets.Dataset`` with the one string column ``text_key``.

    Raises:
        DataError: a file that does not read as its kind, a JSON line that is not JSON or lacks the field
            (naming the file and the line), a Parquet file without the column, or no text at all.
    """
    import datasets
    import pyarrow.compute as pc

    parts = []
    for kind, group in _runs(files):
        ds = {"text": _load_text, "json": _load_json, "parquet": _load_parquet}[kind](
            group, text_key=text_key, cache_dir=str(cache_dir), workers=workers)
        string = datasets.Features({text_key: datasets.Value("string")})
        parts.append(ds if ds.features == string else ds.cast(string))
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    column = ds.data.column(text_key)
    if len(ds) == 0 or not pc.max(pc.binary_length(column)).as_py():
        raise DataError(f"data.source holds no text (its {len(files)} file(s) hold no non-empty document): "
                        "give files with text")
    return ds


def iter_texts(ds, text_key: str, batch_size: int = 1000) -> Iterator[str]:
    """The texts of a loaded dataset, one at a time, a batch in memory at once."""
    for batch in ds.select_columns([text_key]).iter(batch_size=batch_size):
        yield from batch[text_key]


def tokenize(ds, tokenizer, *, text_key: str, dtype: str, workers: int = 1, progress: bool = False):
    """``ds`` as token ids (column ``ids``), EOS appended to each document, over ``workers`` processes.

    Documents keep their order whatever ``workers`` is; those that encode to no token are dropped.
    """
    import datasets

    features = datasets.Features({"ids": datasets.Sequence(datasets.Value(dtype))})
    return ds.map(_encode, batched=True, batch_size=256, num_proc=workers if workers > 1 else None,
                  remove_columns=[text_key], features=features, load_from_cache_file=False,
                  new_fingerprint=hashlib.sha256(f"{ds._fingerprint}:{tokenizer.fingerprint}:{tokenizer.eos_id}"
                                                 .encode()).hexdigest()[:32],
                  fn_kwargs={"tokenizer": tokenizer, "text_key": text_key}, desc="tokenizing" if progress else None)


def _encode(batch: dict, *, tokenizer, text_key: str) -> dict:
    eos = [tokenizer.eos_id]
    return {"ids": [ids + eos for ids in tokenizer.encode_batch(batch[text_key]) if ids]}


def _runs(files: list[Path]) -> Iterator[tuple[str, list[Path]]]:
    """Consecutive files of one kind, grouped (one ``load_dataset`` each, order kept)."""
    group: list[Path] = []
    for f in files:
        if group and LOADERS[f.suffix.lower()] != LOADERS[group[0].suffix.lower()]:
            yield LOADERS[group[0].suffix.lower()], group
            group = []
        group.append(f)
    yield LOADERS[group[0].suffix.lower()], group


def _load(kind: str, files: list[Path], *, cache_dir: str, workers: int, **kwargs):
    import datasets

    return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", cache_dir=cache_dir,
                                 num_proc=min(workers, len(files)) if workers > 1 and len(files) > 1 else None,
                                 **kwargs)


def _load_text(files: list[Path], *, text_key: str, cache_dir: str, workers: int):
    """Load with ``datasets``; look for the file that is not UTF-8 only when that fails."""
    try:
        ds = _load("text", files, cache_dir=cache_dir, workers=workers, sample_by="document", encoding="utf-8")
    except Exception as err:  # noqa: BLE001 - datasets wraps the decoder's error in its own
        for f in files:
            _check_utf8(f)
        raise DataError(f"data.source: {len(files)} text file(s) do not load ({_cause(err)}): "
                        "give UTF-8 text") from None
    return ds.rename_column("text", text_key) if text_key != "text" else ds


def _check_utf8(file: Path) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    at = 0
    with file.open("rb") as f:
        while chunk := f.read(1 << 22):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                raise DataError(f"data.source: {file} is not UTF-8 text (byte {at + err.start}): "
                                "convert it to UTF-8") from None
            at += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"data.source: {file} is not UTF-8 text (it ends inside a character): "
                        "convert it to UTF-8") from None


def _load_json(files: list[Path], *, text_key: str, cache_dir: str, workers: int):
    """Load with ``datasets`` (fast); read the lines with ``json`` only when that fails, to name the bad one."""
    try:
        ds = _load("json", files, cache_dir=cache_dir, workers=workers)
    except Exception as err:  # noqa: BLE001 - datasets wraps pyarrow's errors in its own
        raise DataError(_json_problem(files, text_key) or f"data.source: {len(files)} JSON file(s) do not load "
                        f"({_cause(err)}): give JSON Lines, one object per line") from None
    if text_key not in ds.column_names or not _is_text(ds.features[text_key]) or ds.data.column(text_key).null_count:
        found = ", ".join(ds.column_names)
        raise DataError(_json_problem(files, text_key) or f"data.source: no field {text_key!r} holds text in every "
                        f"line (the fields: {found}): set data.text_key= to the field holding each document's text")
    return ds.select_columns([text_key])


def _is_text(feature) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _json_problem(files: list[Path], text_key: str) -> str | None:
    """The first line of ``files`` that is not a JSON object with a string ``text_key``, as an error."""
    for file in files:
        with file.open("rb") as f:
            for number, line in enumerate(f, 1):
                if number == 1:
                    line = line.removeprefix(codecs.BOM_UTF8)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    why = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8"
                    return f"data.source: {file} line {number} is not valid JSON ({why}): fix or remove that line"
                if not isinstance(record, dict) or text_key not in record:
                    fields = f"its fields: {', '.join(record)}" if isinstance(record, dict) else "not an object"
                    return (f"data.source: {file} line {number} has no field {text_key!r} ({fields}): set "
                            "data.text_key= to the field holding each document's text, or fix that line")
                if not isinstance(record[text_key], str):
                    return (f"data.source: {file} line {number}: field {text_key!r} holds "
                            f"{type(record[text_key]).__name__}, not text: set data.text_key= to the field holding "
                            "each document's text, or fix that line")
    return None


def _load_parquet(files: list[Path], *, text_key: str, cache_dir: str, workers: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in files:
        try:
            schema = pq.read_schema(f)
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"data.source: {f} is not a Parquet file ({_cause(err)}): give an intact one") from None
        if text_key not in schema.names:
            raise DataError(f"data.source: {f} has no column {text_key!r} (its columns: {', '.join(schema.names)}): "
                            "set data.text_key= to the column holding each document's text")
        kind = schema.field(text_key).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"data.source: {f}: column {text_key!r} holds {kind}, not text: set data.text_key= to "
                            "the column holding each document's text")
    ds = _load("parquet", files, cache_dir=cache_dir, workers=workers, columns=[text_key])
    if ds.data.column(text_key).null_count:
        bad = next(f for f in files if pq.read_table(f, columns=[text_key]).column(text_key).null_count)
        raise DataError(f"data.source: {bad}: column {text_key!r} has empty (null) rows: drop them, or set "
                        "data.text_key= to a column with text in every row")
    return ds


def _cause(err: BaseException) -> str:
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
