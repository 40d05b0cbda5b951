"""Read documents from the embedded corpus, a .txt file, a .jsonl file or a directory of .txt files.

Bad input is handled here, once, with counts the trainer reports: undecodable bytes are
replaced (and counted), empty documents are skipped (and counted); a missing path or a corpus
with no usable text is an error naming the path and the fix.
"""
from __future__ import annotations

import json
import lzma
from dataclasses import dataclass, field
from pathlib import Path

from megalite.typed_config import ConfigError

EMBEDDED = Path(__file__).resolve().parent / "corpus" / "python-docs.jsonl.xz"


@dataclass
class Corpus:
    documents: list[str]
    source: str
    skipped_empty: int = 0
    replaced_bytes_docs: int = 0  # documents that held bytes which were not UTF-8
    notes: list[str] = field(default_factory=list)


def corpus_source(path: str) -> Path:
    source = EMBEDDED if path == "embedded" else Path(path)
    if not source.exists():
        raise ConfigError(f"data.path '{path}' does not exist: point data.path at a .txt or "
                          f".jsonl file or a directory of .txt files, or use data.path=embedded")
    return source


def read_corpus(path: str) -> Corpus:
    source = corpus_source(path)
    raw = _read_raw(source)
    corpus = Corpus([], str(source))
    for text, had_bad_bytes in raw:
        text = text.strip()
        if not text:
            corpus.skipped_empty += 1
            continue
        corpus.replaced_bytes_docs += had_bad_bytes
        corpus.documents.append(text)
    if not corpus.documents:
        raise ConfigError(f"data.path '{path}' holds no text ({corpus.skipped_empty} empty "
                          f"documents): give it at least one non-empty document")
    return corpus


def _decode(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def _read_raw(source: Path) -> list[tuple[str, bool]]:
    if source.is_dir():
        files = sorted(source.rglob("*.txt"))
        if not files:
            raise ConfigError(f"data.path '{source}' is a directory without .txt files")
        return [_decode(f.read_bytes()) for f in files]
    opener = lzma.open if source.suffix == ".xz" else open
    with opener(source, "rb") as f:
        data = f.read()
    if ".jsonl" in source.suffixes:
        docs = []
        for number, line in enumerate(data.splitlines(), 1):
            if line.strip():
                text, bad = _decode(line)
                try:
                    docs.append((json.loads(text)["text"], bad))
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ConfigError(f"{source}:{number}: expected a JSON object with a "
                                      f"'text' field ({err})") from None
        return docs
    # A plain text file: documents are separated by two blank lines. Split the bytes first, so
    # that one undecodable byte marks only its own document.
    return [_decode(doc) for doc in data.replace(b"\r\n", b"\n").split(b"\n\n\n")]
