"""The tokenizer's own speed, the baseline `megalite prepare-data` is held against:
`Tokenizer.encode_batch` alone (Rust threads on every core) over a jsonl corpus's documents,
only the encode calls timed."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from bench.data_prep_report import MB
from bench.process_tree import busy_seconds


def jsonl_batches(path: Path, batch_docs: int, limit_bytes: int | None):
    """(texts, jsonl bytes, text bytes) of batch_docs documents at a time, stopping at the first
    batch boundary past limit_bytes. Records as megalite's parse keeps them: whitespace-only
    text is skipped."""
    texts, size, text_size, consumed = [], 0, 0, 0
    with open(path, "rb") as f:
        for line in f:
            size += len(line)
            text = json.loads(line).get("text") if line.strip() else None
            if isinstance(text, str) and text.strip():
                texts.append(text)
                text_size += len(text.encode())
            if len(texts) == batch_docs:
                yield texts, size, text_size
                consumed += size
                texts, size, text_size = [], 0, 0
                if limit_bytes is not None and consumed >= limit_bytes:
                    return
    if texts or size:
        yield texts, size, text_size


def raw_encode(corpus: Path, tokenizer: Path, batch_docs: int, limit_bytes: int | None,
               fast_too: bool = True) -> dict:
    """Time `Tokenizer.encode_batch` alone on the corpus's documents (and, in a pass of its
    own, `encode_batch_fast`). Each pass loads the tokenizer afresh: BPE caches the words it
    has merged, and one pass must not warm that cache for the other."""
    from tokenizers import Tokenizer
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"  # its default: Rust threads on every core
    result: dict = {"corpus_bytes": corpus.stat().st_size, "batch_docs": batch_docs,
                    "limit_bytes": limit_bytes,
                    "threads": int(os.environ.get("RAYON_NUM_THREADS", os.cpu_count() or 1))}
    try:
        for name in ("encode_batch", "encode_batch_fast") if fast_too else ("encode_batch",):
            tok = Tokenizer.from_file(str(tokenizer))
            encode = getattr(tok, name)
            encode(["start the thread pool"] * 64, add_special_tokens=False)
            seconds = cpu = busy = 0.0
            size = text_size = docs = tokens = 0
            start = time.perf_counter()
            for texts, n_bytes, n_text in jsonl_batches(corpus, batch_docs, limit_bytes):
                size, text_size, docs = size + n_bytes, text_size + n_text, docs + len(texts)
                busy0, cpu0, t0 = busy_seconds(), time.process_time(), time.perf_counter()
                encoded = encode(texts, add_special_tokens=False)
                seconds += time.perf_counter() - t0
                cpu += time.process_time() - cpu0
                busy += busy_seconds() - busy0
                tokens += sum(len(e.ids) for e in encoded)
                # Freed before the next call, as a consumer would: kept alive, a batch's
                # encodings make the next call allocate fresh memory (15-40% slower here).
                del encoded
            result.update(measured_bytes=size, measured_text_bytes=text_size, documents=docs,
                          whole_corpus=size == corpus.stat().st_size)
            result[name] = {"seconds": seconds, "tokens": tokens, "mb_per_s": size / MB / seconds,
                            "text_mb_per_s": text_size / MB / seconds, "tokens_per_s": tokens / seconds,
                            "own_cores": cpu / seconds, "others_cores": max(busy - cpu, 0.0) / seconds,
                            "pass_wall_s": time.perf_counter() - start}
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    return result
