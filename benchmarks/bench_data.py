"""The data pipeline, measured: ``chameleon.prepare``'s throughput, and what training on token shards costs.

Run: ``python benchmarks/bench_data.py [--mb 100] [--workers 1 2] [--vocab 32000] [--big-gb 1] [--json FILE]``.

1. **prepare**: a synthetic JSONL corpus of about ``--mb`` MB is generated (seeded: Zipf-distributed words from
   a made-up vocabulary, documents of varied length), a byte-level BPE is trained on it once with ``tokenizers``
   and saved as a tokenizer.json, then the command is run on it once per worker count, each a fresh process
   writing a fresh folder, timed whole (interpreter start included). The shards of every run must be
   byte-identical. CPU is the process's and its workers' together (``tokenizers`` also runs threads).
2. **memory**: token shards of ``--big-gb`` GB and of 10 MB (seeded random ids, documents of varied length) are
   written with the shard writer; the same training job (4 workers, dp2 × pp2, no fault, no validation) runs
   on each, and each worker's peak RSS (``summary.json``'s ``peak_rss_mb``) is compared: the goal is within 10 %.
3. **stream**: the bundled corpus as it is (a text file, held in memory) and prepared with ``data.tokenizer=bytes``
   (the same tokens, read from shards by window): samples/s of the sample stream alone (``batch`` of a micro-batch, the
   worker's data path) and of the same training job, side by side, alternating; the goal is a ratio ≥ 0.95.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_corpus(path: Path, mb: float, seed: int = 0) -> int:
    """Write about ``mb`` MB of JSONL documents; their count."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = ["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(20_000)]
    cum, total = [], 0.0
    for r in range(len(words)):
        total += 1 / (r + 1)
        cum.append(total)
    target, written, docs = int(mb * 1e6), 0, 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            n = int(rng.lognormvariate(5.5, 0.8)) + 5  # words per document: a few to a few thousand
            sentences = []
            for chunk in range(0, n, 12):
                s = " ".join(rng.choices(words, cum_weights=cum, k=min(12, n - chunk)))
                sentences.append(s.capitalize() + rng.choice([".", ".", ".", "?", "!", ";"]))
            line = json.dumps({"text": " ".join(sentences), "id": docs}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def train_tokenizer(corpus: Path, out: Path, vocab: int) -> float:
    """Train the byte-level BPE once (the seconds it took); saved as ``out/tokenizer.json``."""
    from chameleon.data.tokenizer import load_tokenizer

    def texts():
        with corpus.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    start = time.perf_counter()
    load_tokenizer(f"bpe:{vocab}", train_on=texts(), save_to=out)
    return time.perf_counter() - start


def run_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    """One run of the command, timed: wall and CPU seconds, and what it wrote."""
    cmd = [sys.executable, "-m", "chameleon.prepare", f"data.source={corpus}", f"data.path={out}",
           f"data.tokenizer={tokenizer}", f"data.workers={workers}", "output.progress=false"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    manifest = json.loads((out / "manifest.json").read_text())
    digest = hashlib.sha256()
    for shard in manifest["shards"]:
        digest.update((out / shard["file"]).read_bytes())
        digest.update((out / shard["docs"]).read_bytes())
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"workers": workers, "wall_s": wall, "cpu_s": cpu, "tokens": manifest["tokens"],
            "documents": manifest["documents"], "shards": len(manifest["shards"]),
            "tokens_per_s": manifest["tokens"] / wall,
            "digest": digest.hexdigest()}


TRAIN_JOB = ["model.dim=64", "model.n_layers=4", "train.global_batch=16", "train.micro_batch=4", "train.seq_len=64",
             "launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2", "failure=none", "train.eval_interval=0",
             "data.val_fraction=0", "output.progress=false", "output.save_params=false", "report.plots=false"]


def write_random_shards(out: Path, n_tokens: int, *, seed: int = 0) -> None:
    """Token shards of ``n_tokens`` seeded random ids (vocabulary 256, EOS 0), documents of 200 to 20,000 tokens."""
    import numpy as np

    from chameleon.data.shards import FORMAT, Manifest, ShardWriter, TokenizerEntry, write_manifest

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    writer = ShardWriter(out, dtype="uint16")
    left = n_tokens
    while left > 0:
        lengths = np.minimum(rng.integers(200, 20_000, size=4096), left)
        lengths = lengths[np.cumsum(lengths) <= left] if lengths.sum() > left else lengths
        lengths = lengths if len(lengths) else np.array([left])
        tokens = rng.integers(1, 256, size=int(lengths.sum()), dtype=np.uint16)
        tokens[np.cumsum(lengths) - 1] = 0  # EOS ends each document
        writer.add(tokens, lengths)
        left -= int(lengths.sum())
    entries = writer.close()
    write_manifest(out, Manifest(FORMAT, "random", TokenizerEntry("bytes", "random", "\0"), 256, 0, "uint16", "text",
                                 n_tokens, sum(e.documents for e in entries), 255, tuple(entries), ()))


def train(work: Path, name: str, data: str, steps: int) -> dict:
    """The training job on ``data``; its summary."""
    run_dir = work / f"run-{name}"
    cmd = [sys.executable, "-m", "chameleon.train", f"hydra.run.dir={run_dir}", f"data.path={data}",
           f"train.steps={steps}", *TRAIN_JOB]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def stream_rate(data: str, *, seconds: float = 3.0) -> float:
    """Samples/s of the training stream alone, micro-batches of 4 read in sample order."""
    from chameleon.config import DataConfig
    from chameleon.data.stream import open_streams

    stream = open_streams(DataConfig(path=data, val_fraction=0.0), seq_len=64, seed=0).train
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        stream.batch(range(n, n + 4))
        n += 4
    return n / (time.perf_counter() - start)


def measure_memory(work: Path, big_gb: float, steps: int) -> dict:
    sizes = {"10MB": 5_000_000, f"{big_gb:g}GB": int(big_gb * 1e9 / 2)}  # uint16: 2 bytes a token
    out = {}
    for name, n in sizes.items():
        folder = work / f"random-{name}"
        start = time.perf_counter()
        write_random_shards(folder, n)
        summary = train(work, f"memory-{name}", str(folder), steps)
        out[name] = {"tokens": n, "bytes": 2 * n, "write_s": time.perf_counter() - start,
                     "peak_rss_mb": summary["peak_rss_mb"], "samples_per_s": summary["samples_per_s"]}
    return out


def measure_stream(work: Path, steps: int, repeats: int) -> dict:
    from chameleon.data.stream import BUNDLED_CORPUS, load_corpus

    text = work / BUNDLED_CORPUS
    text.write_text(load_corpus(None), encoding="utf-8")
    shards = work / "bundled-bytes"
    cmd = [sys.executable, "-m", "chameleon.prepare", f"data.source={text}", f"data.path={shards}", "data.tokenizer=bytes"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=work)
    rows = {"in memory (text file)": [], "shards (pread)": []}
    train_rows = {key: [] for key in rows}
    for _ in range(repeats):  # alternating, so both see the same host
        for key, data in zip(rows, (str(text), str(shards))):
            rows[key].append(stream_rate(data))
            train_rows[key].append(train(work, f"stream-{len(train_rows[key])}-{key[:2]}", data, steps)["samples_per_s"])
    best = {key: max(v) for key, v in rows.items()}
    best_train = {key: max(v) for key, v in train_rows.items()}
    mm, mem = "shards (pread)", "in memory (text file)"
    return {"stream_samples_per_s": rows, "train_samples_per_s": train_rows,
            "stream_ratio": best[mm] / best[mem], "train_ratio": best_train[mm] / best_train[mem]}


def _load(avg: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.1f}" for x in avg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in MB (default 100)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    parser.add_argument("--vocab", type=int, default=32_000, help="BPE vocabulary (default 32000)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="keep the corpus and shards here (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--big-gb", type=float, default=1.0, help="the large token file of part 2, GB (default 1)")
    parser.add_argument("--steps", type=int, default=60, help="training steps of parts 2 and 3 (default 60)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats of part 3 (default 3)")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], help="which parts to run (default all)")
    args = parser.parse_args()
    import datasets
    import tokenizers

    print("command:", " ".join(["python", "benchmarks/bench_data.py", *sys.argv[1:]]))
    load_before = os.getloadavg()
    print(f"env: Python {platform.python_version()}, datasets {datasets.__version__}, tokenizers "
          f"{tokenizers.__version__}, {os.cpu_count()} CPU cores (load avg {_load(load_before)})", flush=True)
    result: dict = {"command": ["python", "benchmarks/bench_data.py", *sys.argv[1:]], "load_before": load_before}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as temp:
        work = args.dir or Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        if 1 in args.parts:
            result["prepare"] = part_prepare(work, args)
        if 2 in args.parts:
            result["memory"] = memory = measure_memory(work, args.big_gb, args.steps)
            print(f"\n{'corpus':>8} {'tokens':>12} {'write s':>8} {'worker peak RSS MB':>40} {'samples/s':>9}")
            for name, r in memory.items():
                rss = " ".join(f"{v:.0f}" for v in r["peak_rss_mb"].values())
                print(f"{name:>8} {r['tokens']:>12} {r['write_s']:>8.1f} {rss:>40} {r['samples_per_s']:>9.1f}")
            small, big = (max(r["peak_rss_mb"].values()) for r in memory.values())
            result["rss_ratio"] = big / small
            print(f"largest worker peak RSS, large ÷ small corpus: {big / small:.3f} (goal ≤ 1.10: "
                  f"{'met' if big / small <= 1.10 else 'MISSED'})")
        if 3 in args.parts:
            result["stream"] = stream = measure_stream(work, args.steps, args.repeats)
            for what in ("stream_samples_per_s", "train_samples_per_s"):
                print(f"\n{what.replace('_', ' ')} (each repeat, alternating)")
                for key, values in stream[what].items():
                    print(f"  {key:<24} " + " ".join(f"{v:9.1f}" for v in values))
            for what in ("stream_ratio", "train_ratio"):
                print(f"{what.replace('_', ' ')}, shards ÷ in memory (best of each): {stream[what]:.3f} "
                      f"(goal ≥ 0.95: {'met' if stream[what] >= 0.95 else 'MISSED'})")
    result["load_after"] = os.getloadavg()
    print(f"load avg before {_load(load_before)}, after {_load(result['load_after'])}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if "prepare" in result and not result["prepare"]["identical"]:
        sys.exit(1)


def part_prepare(work: Path, args) -> dict:
    """Part 1: the command's throughput by worker count, on a generated corpus."""
    corpus = work / "corpus.jsonl"
    start = time.perf_counter()
    docs = make_corpus(corpus, args.mb)
    size = corpus.stat().st_size
    print(f"corpus: {size / 1e6:.1f} MB, {docs} documents, generated in {time.perf_counter() - start:.1f} s")
    train_s = train_tokenizer(corpus, work / "bpe", args.vocab)
    print(f"tokenizer: byte-level BPE of {args.vocab} tokens trained once in {train_s:.1f} s "
          f"({work / 'bpe' / 'tokenizer.json'})", flush=True)
    rows = [run_prepare(corpus, work / "bpe" / "tokenizer.json", work / f"shards-w{w}", w) for w in args.workers]
    print(f"\n{'workers':>7} {'wall s':>8} {'CPU s':>8} {'tokens':>12} {'tokens/s':>11} {'MB/s':>6} {'shards':>6}")
    for r in rows:
        print(f"{r['workers']:>7} {r['wall_s']:>8.2f} {r['cpu_s']:>8.2f} {r['tokens']:>12} {r['tokens_per_s']:>11.0f} "
              f"{size / 1e6 / r['wall_s']:>6.2f} {r['shards']:>6}")
    same = len({r["digest"] for r in rows}) == 1
    print(f"shards byte-identical across worker counts: {'yes' if same else 'NO'}")
    return {"corpus_bytes": size, "documents": docs, "vocab": args.vocab, "train_s": train_s, "runs": rows,
            "identical": same}


if __name__ == "__main__":
    main()
