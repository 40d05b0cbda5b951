"""Raw text in, in bounded chunks: .jsonl (plain, .gz, .zst, .xz), .parquet, .txt, directories.

A .jsonl line is a JSON object whose text field (data.text_key, default "text") is a document;
a parquet row's text column likewise (FineWeb's layout); in a .txt file documents are separated
by two blank lines.

The reader (one process) only splits files into chunks of about a MiB of records; a worker
parses a chunk (`parse`) and tokenizes it. Nothing holds more than a chunk of a file, so memory
does not grow with the corpus. Every record is accounted for per file: written, or skipped as
empty, not JSON, or without the text field (with its line, or its row in a parquet file);
bytes that are not UTF-8 are replaced and the documents holding them counted.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import lzma
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from megalite.typed_config import ConfigError

EMBEDDED = Path(__file__).resolve().parent / "corpus" / "python-docs.jsonl.xz"
CHUNK_BYTES = 1 << 20
SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.xz", ".parquet", ".txt")
KEEP_BAD = 20  # bad records listed by line per file (all are counted)


def kind_of(path: Path) -> str | None:
    name = path.name
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, directories (every supported file under them) and globs, in a stable order."""
    files: list[Path] = []
    for item in inputs:
        matches = sorted(glob.glob(item, recursive=True)) if glob.has_magic(item) else [item]
        if not matches or not Path(matches[0]).exists():
            raise ConfigError(f"input '{item}' does not exist: give .jsonl, .jsonl.gz, "
                              f".jsonl.zst, .parquet or .txt files, directories or globs of them")
        for match in map(Path, matches):
            if match.is_dir():
                found = sorted(p for p in match.rglob("*") if p.is_file() and kind_of(p))
                if not found:
                    raise ConfigError(f"input directory '{match}' holds no {', '.join(SUFFIXES)} files")
                files += found
            elif kind_of(match):
                files.append(match)
            else:
                raise ConfigError(f"input '{match}' is not a supported file: name it "
                                  f"{' / '.join('*' + s for s in SUFFIXES)}")
    return list(dict.fromkeys(files))


def check_readable(path: Path, text_key: str) -> None:
    """Fail before any work on a file that cannot hold the text (a parquet without the column)."""
    if kind_of(path) == ".parquet":
        import pyarrow.parquet as pq
        schema = pq.ParquetFile(path).schema_arrow
        if text_key not in schema.names:
            raise ConfigError(f"parquet file '{path}' has no column '{text_key}' (its columns: "
                              f"{', '.join(schema.names)}): name the text column with --text-key "
                              f"(data.text_key)")
        kind = str(schema.field(text_key).type)
        if kind not in ("string", "large_string", "string_view"):
            raise ConfigError(f"parquet file '{path}': column '{text_key}' is {kind}, not text")


@dataclass
class Chunk:
    file: int  # index into the run's file list
    first: int  # line (1-based, jsonl) or row (0-based, parquet) or document of its first record
    kind: str  # "json" lines | "text" documents (bytes) | "arrow" strings
    records: object
    read_to: int  # bytes of the file read so far (compressed bytes for a compressed file)


@dataclass
class Counts:
    records: int = 0
    documents: int = 0
    empty: int = 0
    not_json: int = 0
    no_text: int = 0
    invalid_utf8: int = 0
    bad: list = field(default_factory=list)  # "line N: why", at most KEEP_BAD

    def add(self, other: "Counts") -> None:
        for name in ("records", "documents", "empty", "not_json", "no_text", "invalid_utf8"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.bad = (self.bad + other.bad)[:KEEP_BAD]


def read_chunks(path: Path, file: int, text_key: str) -> Iterator[Chunk]:
    kind = kind_of(path)
    if kind == ".parquet":
        yield from _parquet_chunks(path, file, text_key)
    else:
        raw = open(path, "rb")
        with raw, _decompressed(raw, kind) as stream:
            lines = _json_chunks if kind != ".txt" else _text_chunks
            yield from lines(stream, raw, file)


def documents(path: Path, text_key: str = "text", strict: bool = False) -> Iterator[str]:
    """Every document of one file, in order (bad records skipped, or an error if strict)."""
    for chunk in read_chunks(path, 0, text_key):
        yield from parse(chunk, text_key, strict, str(path))[0]


def _decompressed(raw, kind: str):
    if kind == ".jsonl.gz":
        return gzip.GzipFile(fileobj=raw)
    if kind == ".jsonl.xz":
        return lzma.LZMAFile(raw)
    if kind == ".jsonl.zst":
        import zstandard
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return nullcontext(raw)


def _json_chunks(stream, raw, file: int) -> Iterator[Chunk]:
    lines, size, first = [], 0, 1
    for number, line in enumerate(stream, 1):
        lines.append(line)
        size += len(line)
        if size >= CHUNK_BYTES:
            yield Chunk(file, first, "json", lines, raw.tell())
            lines, size, first = [], 0, number + 1
    if lines:
        yield Chunk(file, first, "json", lines, raw.tell())


def _text_chunks(stream, raw, file: int) -> Iterator[Chunk]:
    """Documents of a .txt file are separated by two blank lines."""
    tail, first = b"", 0
    while block := stream.read(CHUNK_BYTES):
        if block.endswith(b"\r"):
            block += stream.read(1)
        docs = (tail + block.replace(b"\r\n", b"\n")).split(b"\n\n\n")
        tail = docs.pop()
        if docs:
            yield Chunk(file, first, "text", docs, raw.tell())
            first += len(docs)
    yield Chunk(file, first, "text", [tail], raw.tell())


def _parquet_chunks(path: Path, file: int, text_key: str) -> Iterator[Chunk]:
    import pyarrow.parquet as pq
    source = pq.ParquetFile(path)
    size, rows, first = path.stat().st_size, max(1, source.metadata.num_rows), 0
    for batch in source.iter_batches(batch_size=256, columns=[text_key]):
        yield Chunk(file, first, "arrow", batch.column(0), size * (first + len(batch)) // rows)
        first += len(batch)


def parse(chunk: Chunk, text_key: str, strict: bool, name: str) -> tuple[list[str], Counts]:
    """The chunk's documents (text as given; whitespace-only ones skipped) and its counts."""
    counts, texts = Counts(), []

    def bad(number: int, why: str, kind: str) -> None:
        where = f"{name}:{number}" if chunk.kind == "json" else f"{name} row {number}"
        if strict:
            raise ConfigError(f"{where}: {why}; fix or drop it, or leave out --strict "
                              f"(data.strict) to skip and count such records")
        setattr(counts, kind, getattr(counts, kind) + 1)
        if len(counts.bad) < KEEP_BAD:
            counts.bad.append(f"{'line' if chunk.kind == 'json' else 'row'} {number}: {why}")

    records = chunk.records.to_pylist() if chunk.kind == "arrow" else chunk.records
    for number, record in enumerate(records, chunk.first):
        counts.records += 1
        if chunk.kind == "arrow":
            if record is None:
                bad(number, f"'{text_key}' is null", "no_text")
                continue
            text = record
        else:
            text, replaced = _decode(record)
            if chunk.kind == "json":
                if not text.strip():
                    counts.empty += 1
                    continue
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as err:
                    bad(number, f"not JSON ({err.msg})", "not_json")
                    continue
                text = value.get(text_key) if isinstance(value, dict) else None
                if not isinstance(text, str):
                    bad(number, f"no string field '{text_key}'", "no_text")
                    continue
            else:
                text = text.strip("\n")
            counts.invalid_utf8 += replaced
        if not text.strip():
            counts.empty += 1
            continue
        texts.append(text)
    counts.documents = len(texts)
    return texts, counts


def _decode(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True
