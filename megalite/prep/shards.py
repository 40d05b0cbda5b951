"""Stream raw files through N tokenizing processes into Megatron-format shards.

    out/ tokenizer.json, tokenizer_config.json, special_tokens_map.json (the tokenizer, its
         special tokens named: save_tokenizer), meta.json,
         NNNNN-<name>.bin/.idx (a shard: one input file's documents, or with --shard-size-gb
                               those of consecutive files, named for its first),
         NNNNN-<name>.json (that shard's files and counts: written last, it marks it complete)

The reader splits each file into chunks (sources.py) and keeps at most two per worker in
flight, so memory is bounded by the chunk size, not the corpus. Results come back in order, so
the shards are the same for any number of workers (workers.py). A shard is written under temporary names
and renamed when whole: a killed run leaves no half shard, and running the same command again
prepares only the files whose shard is missing, or was made from another version of a file it
holds or with other settings. One run at a time holds the output directory (a file lock).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from itertools import chain, count
from pathlib import Path
from typing import Iterator

import numpy as np

from megalite.data.chat import TRAIN_ON, load_chat_template
from megalite.data.indexed import (ShardWriter, bin_path, check_dtype_holds, idx_path, is_indexed,
                                   targets_path, token_dtype, write_atomic)
from megalite.prep.locks import lock_waiting
from megalite.data.prepared import FORMAT
from megalite.data.record_counts import COUNT_KEYS, Counts, summed
from megalite.prep.sources import RawChunk, check_readable, documents, read_chunks
from megalite.data.tokenizer import TokenizerInfo, load_tokenizer, save_tokenizer, train_bpe
from megalite.prep import workers
from megalite.progress import Progress
from megalite.typed_config import ConfigError

VERSION = 2
IN_FLIGHT_PER_WORKER = 2
LINE_EVERY_S = 10.0  # off a terminal: a progress line at most this often


@dataclass(frozen=True)
class PrepareSettings:
    # a tokenizer.json or a Hugging Face tokenizer directory; None: a byte-level BPE trained here
    tokenizer: str | None = None
    eos_token: str | None = None  # the given tokenizer's end of document, when its files do not say
    workers: int = 0  # tokenizing processes; 0 tokenizes in this process
    text_key: str = "text"
    strict: bool = False  # a bad record is an error instead of counted
    bpe_vocab_size: int = 4096
    bpe_sample_mb: float = 100.0  # the BPE learns from this many MB of documents
    dtype: str = "auto"  # token ids on disk: auto (uint16 while the vocabulary fits) | uint16 | int32
    progress: bool = True
    # a shard closes after the input file that brings it to this many GB of tokens (a larger
    # file is one shard of its own); 0: one shard per input file
    shard_size_gb: float = 0.0
    # conversations (jsonl records of `messages`, or `prompt` and `completion`) rendered with a
    # chat template, each token a target or not (data/chat.py): chat_template None: documents
    chat_template: str | None = None  # "auto": the tokenizer's own; else a template or a .jinja file
    train_on: str = "assistant"  # assistant | last | all

    @classmethod
    def named_in(cls, given, **more) -> PrepareSettings:
        """The settings that `given` (prepare-data's arguments, a run's data section) holds under
        these fields' names, `more` over them."""
        named = {f.name: getattr(given, f.name) for f in fields(cls) if hasattr(given, f.name)}
        return cls(**{**named, **more})


def prepare_directory(files: list[Path], out: Path, settings: PrepareSettings,
                      lock: Path | None = None) -> dict:
    """Prepare `files` into `out` (finishing an earlier run there); returns meta.json's content."""
    if not settings.shard_size_gb >= 0:
        raise ConfigError(f"--shard-size-gb {settings.shard_size_gb} must be >= 0 (0: one shard "
                          f"per input file)")
    if settings.chat_template is not None:
        if settings.tokenizer is None:
            raise ConfigError("conversations (--chat-template, data.chat_template) need the model's "
                              "tokenizer: give --tokenizer (data.tokenizer), whose template renders them")
        if settings.train_on not in TRAIN_ON:
            raise ConfigError(f"--train-on {settings.train_on} (data.train_on): use one of "
                              f"{', '.join(TRAIN_ON)}")
    for f in files:
        check_readable(f, settings.text_key, conversations=settings.chat_template is not None)
    out.mkdir(parents=True, exist_ok=True)
    with lock_waiting(lock or out / ".lock", f"prepare-data waits for another run preparing into {out}"):
        info = _tokenizer(files, out, settings)
        dtype = np.dtype(token_dtype(info.vocab_size) if settings.dtype == "auto" else settings.dtype)
        check_dtype_holds(dtype, info.vocab_size, f"--dtype {dtype.name}")
        made_with = {"dtype": dtype.name, "text_key": settings.text_key, "strict": settings.strict,
                     "tokenizer_sha256": info.digest}
        chat = None  # for conversations: (the chat template's source, train_on)
        if settings.chat_template is not None:  # documents' shards keep the records they had
            template = load_chat_template(info, None if settings.chat_template == "auto"
                                          else settings.chat_template).source
            write_atomic(out / "chat_template.jinja", template)
            chat = template, settings.train_on
            made_with.update(chat_template_sha256=hashlib.sha256(template.encode()).hexdigest(),
                             train_on=settings.train_on)
        names = [f"{i:05d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', f.name)}" for i, f in enumerate(files)]
        shards, todo = whole_shards(out, files, names, made_with)
        for i in set(range(len(files))) - set(shards):  # shards of an earlier run not kept
            for path in (out / f"{names[i]}.json", bin_path(out / names[i]), idx_path(out / names[i]),
                         targets_path(out / names[i])):
                path.unlink(missing_ok=True)
        if todo:
            # Until every shard is whole again, no meta.json may describe the directory.
            (out / "meta.json").unlink(missing_ok=True)
            shards.update(_run(todo, files, names, out, dtype, made_with, settings, chat))
        records = [shards[i] for i in sorted(shards)]
        kept = json.loads((out / "meta.json").read_text()) if (out / "meta.json").is_file() else None
        if kept is not None and kept.get("version") == VERSION and kept["shards"] == records:
            # Nothing changed: meta.json stays byte for byte, as the data key is its hash (an
            # earlier version's lacks the fields written since, which nothing needs).
            return kept
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name,
                "tokenizer": {"file": "tokenizer.json", "sha256": made_with["tokenizer_sha256"],
                              "vocab_size": info.vocab_size, "eos_id": info.eos_id,
                              "bos_id": info.bos_id, "pad_id": info.pad_id},
                "text_key": settings.text_key, "shards": records,
                **summed(records, ("tokens",) + COUNT_KEYS)}
        write_atomic(out / "meta.json", json.dumps(meta, indent=1))
    return meta


def _tokenizer(files: list[Path], out: Path, settings: PrepareSettings) -> TokenizerInfo:
    """The given tokenizer (refused if `out` holds shards of another), the BPE an earlier run
    trained with the same settings, or a byte-level BPE trained on a sample of the documents."""
    target = out / "tokenizer.json"
    if settings.tokenizer is not None:
        given = load_tokenizer(Path(settings.tokenizer), settings.eos_token)
        if target.is_file() and load_tokenizer(out).digest != given.digest:
            raise ConfigError(f"output directory '{out}' holds data of another tokenizer "
                              f"(its tokenizer.json or eos differs from '{settings.tokenizer}'): "
                              f"use a new output directory, or the tokenizer it was made with")
        if not target.is_file():
            save_tokenizer(given, out)
        return given
    bpe = {"bpe_vocab_size": settings.bpe_vocab_size, "bpe_sample_mb": settings.bpe_sample_mb,
           "text_key": settings.text_key}
    trained = out / "tokenizer.bpe.json"  # the settings the directory's BPE was trained with
    if target.is_file():
        trained_with = json.loads(trained.read_text()) if trained.is_file() else None
        if trained_with == bpe:
            return load_tokenizer(target)
        if any(out.glob("[0-9][0-9][0-9][0-9][0-9]-*.json")):  # shards were made with it
            made = f"a BPE trained with {trained_with}" if trained_with else "a tokenizer it did not train"
            raise ConfigError(f"output directory '{out}' holds shards of {made}, not of a BPE with "
                              f"{bpe}: use a new output directory, the settings it was made with, "
                              f"or --tokenizer {target} to add to it")
        target.unlink()  # a BPE no shard uses (a failed first run): trained again below
    seen = Counts()
    sample = _sample(files, settings, int(settings.bpe_sample_mb * 1e6), seen)
    first = next(sample, None)
    if first is None:
        raise ConfigError(f"the inputs hold no document to train a BPE on ({seen.records} records, "
                          f"{seen.empty} empty, {seen.not_json + seen.no_text} without a text "
                          f"field '{settings.text_key}'): give non-empty documents, name the "
                          f"field with --text-key (data.text_key), or give --tokenizer")
    if settings.progress:  # it reads and learns for minutes on a large sample, silently
        print(f"prepare-data: training a byte-level BPE of {settings.bpe_vocab_size:,} tokens on up "
              f"to {settings.bpe_sample_mb:g} MB of documents...", file=sys.stderr, flush=True)
    started, taken = time.perf_counter(), count()
    fresh = out / ".bpe.tokenizer.json"
    # zip draws a document before a count: `taken` stops at the number of documents trained on
    texts = (text for text, _ in zip(chain([first], sample), taken))
    train_bpe(texts, settings.bpe_vocab_size).save(str(fresh))
    if settings.progress:
        print(f"prepare-data: BPE trained on {next(taken):,} documents in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    write_atomic(trained, json.dumps(bpe))
    save_tokenizer(load_tokenizer(fresh), out)
    fresh.unlink()
    return load_tokenizer(out)


def _sample(files: list[Path], settings: PrepareSettings, budget: int, counts: Counts) -> Iterator[str]:
    """Documents taken from every file in turn (so a mixed corpus trains the BPE on each of
    its parts), until `budget` bytes of text; the records read counted into `counts`."""
    streams = [documents(f, settings.text_key, settings.strict, counts) for f in files]
    taken = 0
    while streams and taken < budget:
        for stream in list(streams):
            text = next(stream, None)
            if text is None:
                streams.remove(stream)
                continue
            taken += len(text.encode("utf-8", "replace"))
            yield text


class _Shard:
    """A shard while its files' chunks come back (conversations' with their targets)."""

    def __init__(self, prefix: Path, first: int, dtype: np.dtype, made_with: dict):
        self.prefix, self.first, self.made_with = prefix, first, made_with
        self.writer = ShardWriter(prefix, dtype, targets="chat_template_sha256" in made_with)
        self.counts, self.tokens, self.sources = Counts(), 0, []  # sources: each file's record
        self.file_counts, self.read = Counts(), 0  # of the file being read

    def add(self, chunk: RawChunk, tokens: np.ndarray, lengths: np.ndarray, counts: Counts,
            targets: np.ndarray | None = None) -> int:
        """Append a chunk's documents (and for conversations, which tokens are targets);
        returns the input bytes it read."""
        self.writer.add(tokens, lengths, targets)
        self.file_counts.add(counts)
        self.tokens += len(tokens)
        read, self.read = chunk.read_to - self.read, chunk.read_to
        return read

    def end_file(self, source: Path, stat: os.stat_result) -> None:
        """The file's chunks are all in; `stat`: the file as it was when reading began, what the
        record keeps, so that a file rewritten meanwhile is prepared again by the next run."""
        counts = self.file_counts
        if counts.records and counts.no_text == counts.records:
            if "chat_template_sha256" in self.made_with:  # conversations
                raise ConfigError(f"'{source}': none of its {counts.records} records gives a "
                                  f"conversation to train on ({counts.bad[0]}): give records of "
                                  f"`messages`, or `prompt` and `completion`, that the chat "
                                  f"template renders with assistant tokens, or leave out "
                                  f"--chat-template (data.chat_template) for text")
            raise ConfigError(f"'{source}': none of its {counts.records} records has the "
                              f"text field '{self.made_with['text_key']}' ({counts.bad[0]}): "
                              f"name the field with --text-key (data.text_key)")
        self.sources.append({"source": str(source), "bytes": stat.st_size,
                             "mtime_ns": stat.st_mtime_ns, **asdict(counts)})
        self.counts.add(counts)
        self.file_counts, self.read = Counts(), 0

    def finish(self) -> dict:
        """Writes the shard, then its marker; returns the marker's record (each file's counts
        kept where the shard holds several)."""
        self.writer.finish()  # (no file at all for a shard of no documents)
        held = {k: self.sources[0][k] for k in ("source", "bytes", "mtime_ns")} \
            if len(self.sources) == 1 else {"sources": self.sources}
        record = {"name": self.prefix.name, **held, **self.made_with, "tokens": self.tokens,
                  **asdict(self.counts)}
        write_atomic(self.prefix.with_name(f"{self.prefix.name}.json"), json.dumps(record, indent=1))
        return record


# Which shards of a prepared directory an earlier run left whole. A shard holds the documents
# of one input file, or of consecutive ones (--shard-size-gb), and is named for its first; its
# marker, NNNNN-<name>.json (_Shard.finish), written last, records the files it holds as they
# were read (name, size, modification time), the settings that make its tokens, and its counts.
# A re-run keeps each shard whose files and settings are unchanged and prepares the rest:
# resumable by input file, at the cost of redoing the whole shard that a changed or unfinished
# file belongs to.


def whole_shards(out: Path, files: list[Path], names: list[str],
                 made_with: dict) -> tuple[dict[int, dict], list[int]]:
    """({first file: record} of the shards an earlier run left whole, met walking the files in
    order, and the files, in order, that no such shard holds)."""
    kept, todo, i = {}, [], 0
    while i < len(files):
        record = _shard_done(out, names[i], files, i, made_with)
        if record is None:
            todo.append(i)
            i += 1
        else:
            kept[i] = record
            i += len(held_files(record))
    return kept, todo


def held_files(record: dict) -> list[dict]:
    """The input files a shard holds, as they were read: a one-file shard names its file
    inline (as before merging existed, so earlier directories stay whole)."""
    return record.get("sources") or [{key: record[key] for key in ("source", "bytes", "mtime_ns")}]


def _shard_done(out: Path, name: str, files: list[Path], first: int, made_with: dict) -> dict | None:
    """The record of shard `name` if an earlier run wrote it whole, with the settings of this
    run, from files `first`, `first` + 1, ... as they are now."""
    marker = out / f"{name}.json"
    if not marker.is_file():
        return None
    record = json.loads(marker.read_text())
    held = [(source["source"], source["bytes"], source["mtime_ns"]) for source in held_files(record)]
    stats = [f.stat() for f in files[first:first + len(held)]]  # one stat per file
    now = [(str(f), stat.st_size, stat.st_mtime_ns) for f, stat in zip(files[first:], stats)]
    if held != now or any(record.get(k) != v for k, v in made_with.items()):  # (fewer files: unequal)
        return None
    prefix = out / name
    whole = not record["documents"] or (is_indexed(prefix) and bin_path(prefix).stat().st_size ==
                                         record["tokens"] * np.dtype(record["dtype"]).itemsize)
    return record if whole else None


def _run(todo: list[int], files: list[Path], names: list[str], out: Path,
         dtype: np.dtype, made_with: dict, settings: PrepareSettings,
         chat: tuple[str, str] | None = None) -> dict[int, dict]:
    """Each run of consecutive files of `todo` in turn: their chunks tokenized in the pool,
    written in order into shards named for their first file, each closed after the file that
    brings it to --shard-size-gb (every file at 0) and at the end of the run. Returns {first
    file: record}. The workers load the tokenizer stored in `out`, the output directory (its
    specials named)."""
    init = (str(out), dtype.name, settings.text_key, settings.strict, chat, settings.workers > 0)
    pool = workers.Workers(settings.workers, init)
    last = set(todo) - {i - 1 for i in todo}  # each run's last file: the next is not to do
    bar = _Progress(sum(files[i].stat().st_size for i in todo), settings.progress)
    # (file, chunk, its ticket) in reading order; (file, None, its stat) ends a file.
    in_flight: deque = deque()
    current: _Shard | None = None
    written: dict[int, dict] = {}
    at = None  # the file whose results are being written

    def consume() -> None:
        nonlocal current, at
        at, chunk, work = in_flight.popleft()
        if current is None:
            current = _Shard(out / names[at], at, dtype, made_with)
        if chunk is None:
            current.end_file(files[at], work)
            if at in last or current.tokens * dtype.itemsize >= settings.shard_size_gb * 1e9:
                written[current.first] = current.finish()
                current = None
            return
        tokens, lengths, counts, targets = pool.result(work)
        bar.update(current.add(chunk, tokens, lengths, counts, targets), chunk.text_bytes(),
                   len(tokens), counts.documents)

    try:
        for i in todo:
            stat = files[i].stat()
            for chunk in read_chunks(files[i], settings.text_key, settings.chat_template is not None):
                in_flight.append((i, chunk, pool.submit(chunk, str(files[i]))))
                while len(in_flight) > IN_FLIGHT_PER_WORKER * settings.workers:
                    consume()
            in_flight.append((i, None, stat))
        while in_flight:
            consume()
    except workers.WorkerDied:
        dying = files[at if at is not None else i]  # the file being written, or read
        raise ConfigError(f"a tokenizing worker died while preparing '{dying}' (most often: out "
                          f"of memory): run again with fewer --workers; the finished shards are "
                          f"kept") from None
    finally:
        if current is not None:
            current.writer.abandon()
        pool.close()
        bar.close()
    return written


class _Progress(Progress):
    """On stderr: how much of the input is read, in the files' own bytes (compressed for a
    compressed file: the sizes known ahead), and the rates in what they mean whatever the
    compression: MB/s of text as decompressed, tokens/s; documents so far."""

    def __init__(self, total_bytes: int, enabled: bool):
        super().__init__(
            total_bytes, lambda read: f"prepare: {read / 1e6:,.1f} of {total_bytes / 1e6:,.1f} MB of "
                                      f"input read ({read / max(total_bytes, 1):.0%})",
            file=sys.stderr, every_s=LINE_EVERY_S, enabled=enabled, desc="prepare", unit="B",
            unit_scale=True, bar_format="{l_bar}{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}{postfix}]")
        self.start = time.perf_counter()
        self.sums = [0, 0, 0, 0]  # input bytes read, text bytes, tokens, documents

    def update(self, *amounts: int) -> None:
        """Add a chunk's (input bytes read, text bytes, tokens, documents)."""
        self.sums = [total + amount for total, amount in zip(self.sums, amounts)]
        read, text, tokens, documents = self.sums
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.show(read, f"{text / 1e6 / elapsed:,.1f} MB/s of text, {tokens / elapsed:,.0f} tok/s, "
                        f"{documents:,} docs")
