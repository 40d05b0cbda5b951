"""Stream raw files through N tokenizing processes into Megatron-format shards.

    out/ tokenizer.json, meta.json, NNNNN-<name>.bin/.idx (one shard per input file),
         NNNNN-<name>.json (that shard's counts: written last, it marks the shard complete)

The reader splits each file into chunks (sources.py) and keeps at most a few per worker in
flight, so memory is bounded by the chunk size, not the corpus. Results come back in order, so
the shards are the same for any number of workers. A shard is written under temporary names
and renamed when whole: a killed run leaves no half shard, and running the same command again
prepares only the files whose shard is missing (or whose file changed since).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import shutil
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import Iterator

import numpy as np

from megalite.data.indexed import ShardWriter, check_dtype_holds, token_dtype
from megalite.data.sources import Chunk, Counts, check_readable, documents, parse, read_chunks
from megalite.data.tokenizer import TokenizerInfo, load_tokenizer, train_bpe
from megalite.typed_config import ConfigError

FORMAT = "megalite-prepared"
VERSION = 2


@dataclass(frozen=True)
class PrepareSettings:
    tokenizer: str | None = None  # a tokenizer.json; None: train a byte-level BPE on a sample
    workers: int = 0  # tokenizing processes; 0 tokenizes in this process
    text_key: str = "text"
    strict: bool = False  # a bad record is an error instead of counted
    bpe_vocab_size: int = 4096
    bpe_sample_mb: float = 100.0  # the BPE learns from the first this many MB of documents
    dtype: str = "auto"  # token ids on disk: auto (uint16 while the vocabulary fits) | uint16 | int32
    progress: bool = True


def prepare_directory(files: list[Path], out: Path, settings: PrepareSettings) -> dict:
    """Prepare `files` into `out` (finishing an earlier run there); returns meta.json's content."""
    for f in files:
        check_readable(f, settings.text_key)
    out.mkdir(parents=True, exist_ok=True)
    info = _tokenizer(files, out, settings)
    dtype = np.dtype(token_dtype(info.vocab_size) if settings.dtype == "auto" else settings.dtype)
    check_dtype_holds(dtype, info.vocab_size, f"--dtype {dtype.name}")
    names = [f"{i:05d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', f.name)}" for i, f in enumerate(files)]
    todo = [i for i, (f, name) in enumerate(zip(files, names)) if not _shard_done(out, name, f, dtype)]
    shards = {}
    if todo:
        shards = _run(files, names, todo, out, info, dtype, settings)
    records = [shards.get(name) or json.loads((out / f"{name}.json").read_text()) for name in names]
    meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name,
            "tokenizer": {"file": "tokenizer.json", "sha256": digest(out / "tokenizer.json"),
                          "vocab_size": info.vocab_size, "eos_id": info.eos_id},
            "text_key": settings.text_key, "shards": records,
            **{key: sum(r[key] for r in records)
               for key in ("records", "documents", "tokens", "empty", "not_json", "no_text", "invalid_utf8")}}
    _write_atomic(out / "meta.json", json.dumps(meta, indent=1))
    return meta


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer(files: list[Path], out: Path, settings: PrepareSettings) -> TokenizerInfo:
    """The given tokenizer (refused if `out` holds shards of another), the one a killed run left,
    or a byte-level BPE trained on the first bpe_sample_mb of documents."""
    target = out / "tokenizer.json"
    if settings.tokenizer is not None:
        given = load_tokenizer(Path(settings.tokenizer))
        if target.is_file() and digest(target) != digest(Path(settings.tokenizer)):
            raise ConfigError(f"output directory '{out}' holds data of another tokenizer "
                              f"(its tokenizer.json differs from '{settings.tokenizer}'): "
                              f"use a new output directory, or the tokenizer it was made with")
        if not target.is_file():
            shutil.copy(settings.tokenizer, out / ".tokenizer.json.tmp")
            os.replace(out / ".tokenizer.json.tmp", target)
        return given
    if not target.is_file():
        budget = int(settings.bpe_sample_mb * 1e6)
        sample = _sample(files, settings, budget)
        train_bpe(sample, settings.bpe_vocab_size).save(str(out / ".tokenizer.json.tmp"))
        os.replace(out / ".tokenizer.json.tmp", target)
    return load_tokenizer(target)


def _sample(files: list[Path], settings: PrepareSettings, budget: int) -> Iterator[str]:
    taken = 0
    for text in chain.from_iterable(documents(f, settings.text_key, settings.strict) for f in files):
        if taken >= budget:
            return
        taken += len(text)
        yield text


def _shard_done(out: Path, name: str, source: Path, dtype: np.dtype) -> bool:
    """Whether an earlier run wrote this file's whole shard, from the file as it is now."""
    marker = out / f"{name}.json"
    if not marker.is_file():
        return False
    record = json.loads(marker.read_text())
    stat = source.stat()
    return (record["source"], record["bytes"], record["mtime_ns"], record["dtype"]) == \
        (str(source), stat.st_size, stat.st_mtime_ns, dtype.name)


class _Inline:
    """An executor that runs each task as it is submitted (workers=0)."""

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        done.set_result(fn(*args))
        return done

    def shutdown(self, *args, **kwargs) -> None:
        pass


_worker: dict = {}


def _init_worker(tokenizer_path: str, dtype: str, text_key: str, strict: bool,
                 one_thread: bool) -> None:
    if one_thread:  # a worker process: the processes are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(info=load_tokenizer(Path(tokenizer_path)), dtype=np.dtype(dtype),
                   text_key=text_key, strict=strict)


def _encode(chunk: Chunk, name: str) -> tuple[np.ndarray, np.ndarray, Counts]:
    """(tokens, document lengths, counts) of one chunk: each document's ids, then eos."""
    texts, counts = parse(chunk, _worker["text_key"], _worker["strict"], name)
    info: TokenizerInfo = _worker["info"]
    # The fast variant skips character offsets, which a shard never needs.
    ids = [e.ids for e in info.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    lengths = np.fromiter((len(d) + 1 for d in ids), dtype=np.int32, count=len(ids))
    eos = [info.eos_id]
    tokens = np.fromiter(chain.from_iterable(chain.from_iterable((d, eos) for d in ids)),
                         dtype=_worker["dtype"], count=int(lengths.sum()))
    return tokens, lengths, counts


class _Shard:
    """The shard of one input file while its chunks come back."""

    def __init__(self, out: Path, name: str, source: Path, dtype: np.dtype):
        self.out, self.name, self.source = out, name, source
        self.writer, self.counts, self.tokens, self.read = ShardWriter(out / name, dtype), Counts(), 0, 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, counts: Counts) -> None:
        self.writer.add(tokens, lengths)
        self.counts.add(counts)
        self.tokens += len(tokens)

    def finish(self) -> dict:
        self.writer.finish()
        stat = self.source.stat()
        record = {"name": self.name, "source": str(self.source), "bytes": stat.st_size,
                  "mtime_ns": stat.st_mtime_ns, "dtype": self.writer.dtype.name,
                  "tokens": self.tokens, **asdict(self.counts)}
        _write_atomic(self.out / f"{self.name}.json", json.dumps(record, indent=1))
        return record


def _run(files, names, todo, out: Path, info: TokenizerInfo, dtype: np.dtype,
         settings: PrepareSettings) -> dict[str, dict]:
    init = (str(out / "tokenizer.json"), dtype.name, settings.text_key, settings.strict,
            settings.workers > 0)
    if settings.workers > 0:
        pool = ProcessPoolExecutor(settings.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=init)
    else:
        _init_worker(*init)
        pool = _Inline()
    bar = _Progress(sum(files[i].stat().st_size for i in todo), settings.progress)
    written: dict[str, dict] = {}
    shard: _Shard | None = None

    def consume(item) -> None:
        nonlocal shard
        if isinstance(item, _Shard):
            shard = item
        elif item is None:
            written[shard.name] = shard.finish()
        else:
            chunk, future = item
            tokens, lengths, counts = future.result()
            shard.add(tokens, lengths, counts)
            bar.update(chunk.read_to - shard.read, len(tokens), counts.documents)
            shard.read = chunk.read_to

    in_flight: deque = deque()
    try:
        for i in todo:
            in_flight.append(_Shard(out, names[i], files[i], dtype))
            for chunk in read_chunks(files[i], i, settings.text_key):
                in_flight.append((chunk, pool.submit(_encode, chunk, str(files[i]))))
                while len(in_flight) > 2 * max(1, settings.workers) + 1:
                    consume(in_flight.popleft())
            in_flight.append(None)  # the file's end
        while in_flight:
            consume(in_flight.popleft())
    finally:
        if shard is not None and shard.name not in written:
            shard.writer.abandon()
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return written


class _Progress:
    """MB/s of input, tokens/s and documents, on stderr."""

    def __init__(self, total_bytes: int, enabled: bool):
        from tqdm import tqdm
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare",
                        disable=not enabled, dynamic_ncols=True)
        self.start, self.tokens, self.documents = time.perf_counter(), 0, 0

    def update(self, read: int, tokens: int, documents: int) -> None:
        self.tokens += tokens
        self.documents += documents
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s, {self.documents:,} docs", refresh=False)
        self.bar.update(read)

    def close(self) -> None:
        self.bar.close()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
