"""Raw text in, in bounded chunks: .jsonl (plain, .gz, .zst, .xz), .parquet, .txt, directories.

A .jsonl line is a JSON object whose text field (data.text_key, default "text") is a document,
kept exactly as given; a parquet row's text column likewise (FineWeb's layout); in a .txt file
documents are separated by two blank lines (their edge newlines dropped).

The reader (one process) only splits files into chunks of about a MiB of records; a worker
parses a chunk (`parse`) and tokenizes it. Nothing holds more than a chunk of a file (or one
.txt document), so memory does not grow with the corpus. Every record is accounted for per
file: written, or skipped as empty, not JSON, or without the text field (with its line, from
1, or its row in a parquet file, from 0; counted per reason); bytes that are not UTF-8 (and lone
UTF-16 surrogates in JSON escapes) are replaced and the documents holding them counted. A file
that cannot be read to its end (truncated or corrupt compression) is an error naming it: never
a silently short shard.
"""
import gzip
import io
import json
import lzma
import zlib
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from megalite.data.chat import ChatError, conversation_of
from megalite.data.raw_files import kind_of
from megalite.data.record_counts import Counts
from megalite.typed_config import ConfigError

CHUNK_BYTES = 1 << 20
BOM = b"\xef\xbb\xbf"


def check_readable(path: Path, text_key: str, conversations: bool = False) -> None:
    """Fail before any work on a file that cannot hold the text (a parquet without the column,
    or whose footer is lost; conversations, known by their shape), or conversations (jsonl
    records, or parquet conversation_columns)."""
    kind = kind_of(path)
    if conversations and kind == ".txt":
        raise ConfigError(f"'{path}': conversations are read from jsonl records or parquet rows "
                          f"(`messages`, or `prompt` and `completion`), not from text")
    if kind == ".parquet":
        import pyarrow.parquet as pq
        with _damage_named(path):
            schema = pq.ParquetFile(path).schema_arrow
        if conversations and conversation_columns(schema.names) is None:
            raise ConfigError(f"parquet file '{path}' has neither a 'messages' column nor "
                              f"'prompt' and 'completion' (its columns: "
                              f"{', '.join(schema.names)}): conversations need one of them")
    if conversations or kind == ".txt":
        return
    # Read as text, a file whose columns (or first record's keys) are a conversation's and not
    # the text field would fail record by record: say what it is instead.
    names = schema.names if kind == ".parquet" else _first_keys(path)
    if text_key not in names and (shape := conversation_columns(names)) is not None:
        raise ConfigError(f"'{path}': these are conversations ({' and '.join(map(repr, shape))}, "
                          f"no text field '{text_key}'): add --chat-template auto "
                          f"(data.chat_template=auto) to render them with the --tokenizer's "
                          f"chat template")
    if kind == ".parquet":
        if text_key not in names:
            raise ConfigError(f"parquet file '{path}' has no column '{text_key}' (its columns: "
                              f"{', '.join(names)}): name the text column with --text-key "
                              f"(data.text_key)")
        kind = str(schema.field(text_key).type)
        if kind not in ("string", "large_string", "string_view"):
            raise ConfigError(f"parquet file '{path}': column '{text_key}' is {kind}, not text")


def _first_keys(path: Path) -> list[str]:
    """The keys of a jsonl file's first record (none where it is not a JSON object)."""
    line = next((line for chunk in read_chunks(path, "") for line in chunk.records if line.strip()), b"")
    try:
        record = json.loads(line)
    except ValueError:
        return []
    return list(record) if isinstance(record, dict) else []


def conversation_columns(names: list[str]) -> list[str] | None:
    """The columns a parquet file's conversations are in: messages, or prompt and completion."""
    return next((list(c) for c in (("messages",), ("prompt", "completion"))
                 if set(c) <= set(names)), None)


@dataclass
class RawChunk:
    first: int  # line (1-based, jsonl) or row (0-based, parquet) or document of its first record
    kind: str  # "json" lines | "text" documents (bytes) | "arrow" strings | "rows" (a RecordBatch)
    records: object
    read_to: int  # bytes of the file read so far (compressed bytes for a compressed file)

    def text_bytes(self) -> int:
        """The records' bytes as read, decompressed: the measure of a rate of reading."""
        if self.kind == "arrow":
            import pyarrow.compute as pc
            return pc.sum(pc.binary_length(self.records)).as_py() or 0
        if self.kind == "rows":
            return self.records.nbytes
        return sum(map(len, self.records))


@contextmanager
def _damage_named(path: Path):
    """A truncated or corrupt file's read error as one that names the file and the fix (only
    the readers' own errors reach it: a generator's consumer raises outside it)."""
    try:
        yield
    # ValueError: pyarrow's ArrowInvalid (a parquet file without its footer, or a bad page header).
    except (EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as err:
        raise ConfigError(f"'{path}' cannot be read to its end ({type(err).__name__}: {err}): "
                          f"the file is truncated or corrupt; fetch it again, or leave it out") from None


def read_chunks(path: Path, text_key: str, conversations: bool = False) -> Iterator[RawChunk]:
    """conversations: a parquet file's rows of conversation_columns."""
    kind = kind_of(path)
    if kind == ".parquet":
        with _damage_named(path):
            yield from _parquet_chunks(path, text_key, conversations)
        return
    with open(path, "rb") as raw, _STREAMS.get(kind, nullcontext)(raw) as stream, _damage_named(path):
        yield from (_text_chunks if kind == ".txt" else _json_chunks)(stream, raw)


def documents(path: Path, text_key: str = "text", strict: bool = False,
              counts: Counts | None = None) -> Iterator[str]:
    """Every document of one file, in order (bad records skipped, or an error if strict), its
    records counted into `counts` as they are read."""
    for chunk in read_chunks(path, text_key):
        texts, seen = parse(chunk, text_key, strict, str(path))
        if counts is not None:
            counts.add(seen)
        yield from texts


class _ZstdStream(io.RawIOBase):
    """zstd frames one after another, decompressed; a stream that stops inside a frame raises
    EOFError (zstandard's own stream reader ends quietly there, losing the frame's tail)."""

    def __init__(self, raw):
        import zstandard
        self.raw, self.new, self.error = raw, zstandard.ZstdDecompressor().decompressobj, zstandard.ZstdError
        self.frame, self.pending = None, b""  # None: no byte read yet

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            data = self.raw.read(CHUNK_BYTES)
            if not data:
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("zstd stream ended inside a frame")
                return 0
            while data:
                if self.frame is None or self.frame.eof:
                    self.frame = self.new()
                try:
                    self.pending += self.frame.decompress(data)
                except self.error as err:
                    raise OSError(f"corrupt zstd data: {err}") from None
                data = self.frame.unused_data
        n = min(len(buffer), len(self.pending))
        buffer[:n], self.pending = self.pending[:n], self.pending[n:]
        return n


# The file's bytes as a stream of lines: decompressed, or as they are.
_STREAMS = {".jsonl.gz": lambda raw: gzip.GzipFile(fileobj=raw), ".jsonl.xz": lzma.LZMAFile,
            ".jsonl.zst": lambda raw: io.BufferedReader(_ZstdStream(raw))}


def _json_chunks(stream, raw) -> Iterator[RawChunk]:
    lines, size, first = [], 0, 1
    for number, line in enumerate(stream, 1):
        lines.append(line.removeprefix(BOM) if number == 1 else line)
        size += len(lines[-1])
        if size >= CHUNK_BYTES:
            yield RawChunk(first, "json", lines, raw.tell())
            lines, size, first = [], 0, number + 1
    if lines:
        yield RawChunk(first, "json", lines, raw.tell())


def _text_chunks(stream, raw) -> Iterator[RawChunk]:
    """Line by line (linear in the file, a document at most in memory): a document ends at the
    second of two blank lines."""
    docs, size, first, current, blanks = [], 0, 0, [], 0
    for line in stream:
        line = line.replace(b"\r\n", b"\n")
        blanks = blanks + 1 if line == b"\n" else 0
        current.append(line)
        if blanks == 2:
            docs.append(b"".join(current))
            size += len(docs[-1])
            current, blanks = [], 0
            if size >= CHUNK_BYTES:
                yield RawChunk(first, "text", docs, raw.tell())
                first, docs, size = first + len(docs), [], 0
    # What follows the last separator, unless nothing does (no record of its own).
    yield RawChunk(first, "text", docs + ([b"".join(current)] if current else []), raw.tell())


def _parquet_chunks(path: Path, text_key: str, conversations: bool) -> Iterator[RawChunk]:
    import pyarrow.parquet as pq
    source = pq.ParquetFile(path)
    size, rows, first = path.stat().st_size, max(1, source.metadata.num_rows), 0
    columns = conversation_columns(source.schema_arrow.names) if conversations else [text_key]
    for batch in source.iter_batches(batch_size=256, columns=columns):
        yield RawChunk(first, "rows" if conversations else "arrow",
                       batch if conversations else batch.column(0), size * (first + len(batch)) // rows)
        first += len(batch)


class _Skipped(Exception):
    """A record left out: (why, the count it is counted in: Counts.count_bad's kind)."""


def parse(chunk: RawChunk, text_key: str, strict: bool, name: str,
          render: Callable[[list], tuple] | None = None) -> tuple[list, Counts]:
    """The chunk's documents and its counts; whitespace-only documents are skipped.
    render: conversations instead (data/chat.conversation_of), each record's messages made
    (tokens, targets) by it; one it refuses (ChatError) is counted by its line (parquet: row)."""
    counts, texts = Counts(), []
    records = chunk.records.to_pylist() if chunk.kind in ("arrow", "rows") else chunk.records
    for number, record in enumerate(records, chunk.first):
        counts.records += 1
        try:
            text = _document(chunk.kind, record, text_key, render, counts)
        except (ChatError, _Skipped) as bad:
            why, kind = bad.args if isinstance(bad, _Skipped) else (str(bad), "no_text")
            # named by line of a jsonl file (1-based), by row of a parquet file (0-based)
            listed = f"line {number}" if chunk.kind == "json" else f"row {number}"
            counts.count_bad(f"{name}:{number}" if chunk.kind == "json" else f"{name} {listed}",
                             listed, why, kind, strict)
        else:
            if isinstance(text, tuple) or text.strip():  # a conversation's (tokens, targets), or text
                texts.append(text)
            else:
                counts.empty += 1
    counts.documents = len(texts)
    return texts, counts


def _document(kind: str, record, text_key: str, render: Callable | None, counts: Counts) -> str | tuple:
    """One record's text (its bytes not UTF-8 counted), or its conversation rendered (kind
    "rows", or a JSON record given `render`); raises _Skipped or ChatError for a bad record."""
    if kind == "rows":
        # A parquet column of messages has every field any message has, null where one lacks
        # it: absent again, as in the record written (a template asks `is defined`); content stays.
        return render([{k: v for k, v in m.items() if v is not None or k == "content"}
                       for m in conversation_of(record)])
    if kind == "arrow":
        if record is None:
            raise _Skipped(f"'{text_key}' is null", "no_text")
        return record
    try:
        text, replaced = record.decode("utf-8"), False
    except UnicodeDecodeError:
        text, replaced = record.decode("utf-8", errors="replace"), True
    if kind == "text":
        counts.invalid_utf8 += replaced
        return text.strip("\n")
    if not text.strip():
        return ""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise _Skipped(f"not JSON ({err.msg})", "not_json") from None
    if render is not None:
        return render(conversation_of(value if isinstance(value, dict) else {}))
    text = value.get(text_key) if isinstance(value, dict) else None
    if not isinstance(text, str):
        keys = f" (its keys: {', '.join(list(value)[:8])})" if isinstance(value, dict) else ""
        raise _Skipped(f"no string field '{text_key}'{keys}", "no_text")
    if b"\\ud" in record or b"\\uD" in record:  # an escaped UTF-16 surrogate
        # JSON may escape half a UTF-16 pair (scraped text often does): each lone half becomes
        # U+FFFD, as an undecodable byte does; whole pairs are joined into their character.
        fixed = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        text, replaced = fixed, replaced or fixed != text
    counts.invalid_utf8 += replaced
    return text
