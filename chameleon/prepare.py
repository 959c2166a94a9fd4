"""``python -m chameleon.prepare data.source=PATH data.path=DIR [data.tokenizer=SPEC]``: a corpus as token shards.

Reads the source (a file or a folder, :mod:`chameleon.data.sources`), tokenizes it over
``data.workers`` processes (:mod:`chameleon.data.tokenizer`) and writes memory-mappable shards and
their manifest into ``data.path`` (:mod:`chameleon.data.shards`); training reads them with the same
``data.path``. A rerun on unchanged sources with the same tokenizer writes nothing. The last line
printed is the manifest's path and the token count. Nothing is written outside ``data.path``
(Hydra's run directory and log are off; ``datasets``' Arrow files go to a temporary folder).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig

from chameleon import cli
from chameleon.config import CONF_DIR, ConfigError, DataConfig, register_configs, typed
from chameleon.data.shards import (
    FORMAT,
    MANIFEST,
    DataError,
    Manifest,
    ShardWriter,
    TokenizerEntry,
    check_shards,
    clear,
    dtype_for,
    write_manifest,
)
from chameleon.data.sources import describe_sources, list_sources
from chameleon.data.tokenizer import BPE_EOS, Tokenizer, load_tokenizer, parse_spec, tokenizer_of
from chameleon.report.progress import on_terminal, progress_bar

EXAMPLE = "python -m chameleon.prepare data.source=corpus.jsonl data.path=shards data.tokenizer=bpe:32000"

USAGE = f"""
usage: python -m chameleon.prepare data.source=PATH data.path=DIR [data.tokenizer=SPEC] [data.text_key=KEY]
       [data.eos_token=TOKEN] [data.workers=N]

Tokenizes a corpus into memory-mappable token shards (DIR/shard-*.bin, DIR/manifest.json) that training
reads with data.path=DIR. Every document ends with the tokenizer's EOS token.

  data.source    a .txt file (one document), a .jsonl/.json file (one document per line, field
                 data.text_key), a .parquet file (column data.text_key), or a folder of them (recursively)
  data.tokenizer bytes (the default; EOS is byte 0) | bpe:N (a byte-level BPE of N tokens trained on the
                 source, saved as DIR/tokenizer.json) | a tokenizer.json or model folder | a SentencePiece
                 or tiktoken tokenizer.model (Llama 2 / Llama 3)
  data.eos_token the end-of-document token, when the tokenizer names none (quote it for Hydra:
                 "data.eos_token='<|eot_id|>'")
  data.workers   tokenizing processes

  {EXAMPLE}
  python -m chameleon.prepare data.source=docs/ data.path=shards data.tokenizer=Llama-3-8B/tokenizer.model

A rerun on unchanged sources with the same tokenizer writes nothing. Exit codes: 0 prepared (or up to
date); 2 bad input (one line names the key and the fix).
"""

_QUIET_HYDRA = ("hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none", "hydra/hydra_logging=none")

register_configs()


@dataclass(frozen=True)
class Prepared:
    manifest_path: Path
    manifest: Manifest
    written: bool  # False: the folder was up to date

    def line(self) -> str:
        """The last line the command prints."""
        m = self.manifest
        if not self.written:
            return f"{self.manifest_path}: up to date, {m.tokens} tokens (same sources and tokenizer; nothing written)"
        return (f"{self.manifest_path}: {m.tokens} tokens, {m.documents} documents in {len(m.shards)} shard(s) "
                f"({m.dtype})")


def check(cfg: DictConfig) -> None:
    """Refuse what cannot be prepared, without reading the corpus.

    Raises:
        ConfigError: a missing or malformed key, naming it and the fix.
        DataError: a missing, unsupported or empty source, or a tokenizer spec that names nothing.
    """
    data = typed(cfg, "data", DataConfig)
    missing = [f"data.{k}=" for k in ("source", "path") if getattr(data, k) is None]
    if missing:
        raise ConfigError(f"{' and '.join(missing)} {'are' if len(missing) > 1 else 'is'} needed (the corpus and "
                          f"the folder for its shards): e.g. {EXAMPLE}")
    if data.workers < 1:
        raise ConfigError(f"data.workers={data.workers}: use 1 or more tokenizing processes")
    if not data.text_key:
        raise ConfigError("data.text_key is empty: name the JSON field or Parquet column holding the text")
    list_sources(data.source)
    parse_spec(data.tokenizer)
    out, source = Path(data.path).expanduser().resolve(), Path(data.source).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"data.path={data.path} is a file: give a folder for the shards")
    if source.is_dir() and out.is_relative_to(source):
        raise ConfigError(f"data.path={data.path} lies inside data.source={data.source}: put the shards elsewhere")
    if (probe := cli.unwritable(out)) is not None:
        raise ConfigError(f"data.path={data.path} cannot be created or written ({probe} is not a writable folder): "
                          "pick a folder you can write")


def prepare(data: DataConfig, *, progress: bool = False, log: Callable[[str], None] = print) -> Prepared:
    """Write ``data.source`` as token shards into ``data.path``, unless they are already there.

    Args:
        data: the ``data`` config (source, path, tokenizer, text_key, eos_token, workers).
        progress: show progress bars (on stderr, only when it is a terminal).
        log: where the lines before the last one go.

    Raises:
        DataError: a source or tokenizer that cannot be used; nothing is written into ``data.path`` then.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    files = list_sources(data.source)
    out = Path(data.path).expanduser().resolve()
    sources = tuple(describe_sources(files))
    trained = parse_spec(data.tokenizer)[0] == "bpe"
    tokenizer = None if trained else load_tokenizer(data.tokenizer, eos_token=data.eos_token)
    current = _up_to_date(out, data, sources, tokenizer)
    if current is not None:
        return Prepared(out / MANIFEST, current, written=False)
    progress = on_terminal(progress)
    _quiet_datasets(progress)
    from chameleon.data.sources import iter_texts, load_texts, tokenize

    with tempfile.TemporaryDirectory(prefix="chameleon-prepare-") as cache:
        texts = load_texts(files, text_key=data.text_key, cache_dir=Path(cache), workers=data.workers)
        log(f"{len(texts)} documents in {len(files)} file(s) ({sum(s.bytes for s in sources)} bytes) of {data.source}")
        out.mkdir(parents=True, exist_ok=True)
        clear(out)
        if tokenizer is None:
            log(f"training {data.tokenizer} on {len(texts)} documents")
            tokenizer = load_tokenizer(data.tokenizer, eos_token=data.eos_token,
                                       train_on=iter_texts(texts, data.text_key), save_to=out)
        log(f"tokenizer {tokenizer.spec}: vocabulary {tokenizer.vocab_size}, EOS {tokenizer.eos_token!r} = "
            f"id {tokenizer.eos_id}; {data.workers} worker(s)")
        if data.workers > 1:  # forked workers must not inherit the tokenizers library's thread pool
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        dtype = dtype_for(tokenizer.vocab_size)
        ids = tokenize(texts, tokenizer, text_key=data.text_key, dtype=dtype, workers=data.workers, progress=progress)
        entries = _write_shards(ids, out, dtype=dtype, progress=progress)
    if not entries:
        raise DataError(f"data.source={data.source}: no document encodes to any token with "
                        f"data.tokenizer={data.tokenizer}: give text, or another tokenizer")
    manifest = Manifest(
        format=FORMAT, source=str(Path(data.source).expanduser().resolve()),
        tokenizer=TokenizerEntry(spec=tokenizer.spec, fingerprint=tokenizer.fingerprint, eos_token=tokenizer.eos_token),
        vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id, dtype=dtype, text_key=data.text_key,
        tokens=sum(e.tokens for e in entries), documents=sum(e.documents for e in entries),
        max_token_id=max(e.max_token_id for e in entries), shards=tuple(entries), sources=sources,
    )
    return Prepared(write_manifest(out, manifest), manifest, written=True)


def _up_to_date(out: Path, data: DataConfig, sources: tuple, tokenizer: Tokenizer | None) -> Manifest | None:
    """The folder's manifest when it is whole and was written from these sources by this tokenizer."""
    try:
        m = check_shards(out)
    except DataError:
        return None
    if m.sources != sources or m.text_key != data.text_key:
        return None
    if tokenizer is None:  # bpe:N: the same spec and EOS, and what it trained on these sources is still there
        if (m.tokenizer.spec, m.tokenizer.eos_token) != (data.tokenizer, data.eos_token or BPE_EOS):
            return None
        try:
            tokenizer_of(out)
        except DataError:
            return None
        return m
    return m if (m.tokenizer.fingerprint, m.eos_id) == (tokenizer.fingerprint, tokenizer.eos_id) else None


def _write_shards(ids, out: Path, *, dtype: str, progress: bool) -> list:
    """Stream the tokenized documents into shards, a batch of them in memory at a time."""
    import pyarrow.compute as pc

    writer = ShardWriter(out, dtype=dtype)
    with progress_bar(total=len(ids), unit="doc", desc="writing shards", wanted=progress) as bar:
        for table in ids.with_format("arrow").iter(batch_size=4096):
            column = table.column("ids").combine_chunks()
            writer.add(column.flatten().to_numpy(), pc.list_value_length(column).to_numpy())
            bar.update(len(table))
    return writer.close()


def _quiet_datasets(progress: bool) -> None:
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors end as DataError, in one line
    (datasets.enable_progress_bars if progress else datasets.disable_progress_bars)()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def _job(cfg: DictConfig) -> None:
    """Check, prepare, print the manifest's path; bad input ends as one line and exit 2."""
    try:
        check(cfg)
        done = prepare(typed(cfg, "data", DataConfig), progress=cfg.output.progress,
                       log=lambda line: print(line, flush=True))
    except (ConfigError, DataError) as err:
        cli.fail(err)
    print(done.line(), flush=True)


def main() -> None:
    given = {a.split("=")[0] for a in sys.argv[1:]}
    sys.argv += [o for o in _QUIET_HYDRA if o.split("=")[0] not in given]
    cli.run("prepare", USAGE, _job, check)


if __name__ == "__main__":
    main()
