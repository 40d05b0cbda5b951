"""Megatron-LM's indexed dataset on disk: a `.bin` of token ids and an `.idx` that indexes it.

    .idx = b"MMIDIDX\\x00\\x00" | version <Q (1) | dtype code <B
           | sequence count <Q | document count <Q (documents + 1)
           | sequence lengths int32[sequences] | sequence pointers int64[sequences] (bytes into .bin)
           | document indices int64[documents + 1] (the first sequence of each document, then the end)

The same bytes `megatron.core.datasets.indexed_dataset` writes and reads (tests check both
directions against it), so data prepared for Megatron-LM trains here and ours trains there.
megalite writes one sequence per document (the text's tokens, then eos), as Megatron's
`preprocess_data.py --append-eod` does without sentence splitting.

Everything is memory-mapped: opening a shard allocates nothing that grows with its documents.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from megalite.typed_config import ConfigError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
TOKEN_DTYPES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 while every id fits (it keeps a margin below 2**16), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def check_dtype_holds(dtype: np.dtype, vocab_size: int, what: str) -> None:
    top = np.iinfo(dtype).max
    if vocab_size - 1 > top:
        raise ConfigError(f"{what} stores token ids as {dtype.name} (at most {top}), but the "
                          f"tokenizer has {vocab_size} tokens: use the tokenizer the data was "
                          f"made with, or prepare the data again with this one")


def bin_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".bin")


def idx_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".idx")


def is_indexed(prefix: Path) -> bool:
    return idx_path(prefix).is_file() and bin_path(prefix).is_file()


class ShardWriter:
    """Appends documents to `<prefix>.bin`, then writes `<prefix>.idx`: both under temporary
    names, fsynced, until `finish`, so a killed run (or a lost machine) leaves no half shard
    that could be mistaken for one. A shard of no documents is not written at all (Megatron
    cannot map an empty .bin)."""

    def __init__(self, prefix: Path, dtype: np.dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self._tmp_bin = prefix.with_name(f".{prefix.name}.bin.tmp")
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents laid end to end in `tokens`, document i being `lengths[i]` long."""
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))

    def finish(self) -> None:
        if not sum(len(block) for block in self._lengths):
            self.abandon()
            return
        _close_synced(self._bin)
        tmp_idx = self.prefix.with_name(f".{self.prefix.name}.idx.tmp")
        write_index(tmp_idx, self.dtype, self._lengths)
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(tmp_idx, idx_path(self.prefix))

    def abandon(self) -> None:
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)


def _close_synced(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


def write_index(path: Path, dtype: np.dtype, blocks: list[np.ndarray]) -> None:
    """An .idx for one sequence per document, the documents' lengths given in blocks (the
    chunks they were tokenized in) and written a block at a time: a file of many millions of
    documents needs no array of them all at once, beyond the lengths themselves."""
    n, itemsize = sum(len(b) for b in blocks), np.dtype(dtype).itemsize
    f = open(path, "wb")
    f.write(HEADER + struct.pack("<Q", VERSION) + struct.pack("<B", TOKEN_DTYPES[np.dtype(dtype)]))
    f.write(struct.pack("<Q", n) + struct.pack("<Q", n + 1))
    for block in blocks:
        f.write(np.asarray(block, dtype=np.int32).tobytes())
    start = 0  # byte offset of the block's first document
    for block in blocks:
        ends = np.cumsum(block, dtype=np.int64) * itemsize
        f.write((np.concatenate([[0], ends[:-1]]) + start).tobytes())
        start += int(ends[-1]) if len(ends) else 0
    for first in range(0, n + 1, 1 << 20):
        f.write(np.arange(first, min(first + (1 << 20), n + 1), dtype=np.int64).tobytes())
    _close_synced(f)


def _counts_up(doc_index: np.ndarray, block: int = 1 << 20) -> bool:
    """doc_index == 0, 1, 2, ..., compared a block at a time (an index of a billion documents
    would otherwise need an 8 GB arange on every rank)."""
    return all(np.array_equal(doc_index[i:i + block], np.arange(i, min(i + block, len(doc_index))))
               for i in range(0, len(doc_index), block))


class IndexedShard:
    """One `.bin`/`.idx` pair, read in place. Documents are numbered 0..len-1 and their tokens
    lie end to end in the .bin (as every Megatron writer lays them): document d is
    tokens[starts(d) : starts(d + 1)], possibly empty (Megatron keeps empty documents)."""

    def __init__(self, prefix: Path):
        self.prefix = Path(prefix)
        index = np.memmap(idx_path(self.prefix), dtype=np.uint8, mode="r")
        head = bytes(index[:34])
        if head[:9] != HEADER:
            raise ConfigError(f"'{idx_path(self.prefix)}' is not a Megatron indexed dataset index "
                              f"(no MMIDIDX header): give the prefix of a .bin/.idx pair")
        version, code = struct.unpack("<Q", head[9:17])[0], head[17]
        if version != VERSION or DTYPE_CODES.get(code) not in (np.uint16, np.int32, np.int64, np.uint8):
            raise ConfigError(f"'{idx_path(self.prefix)}': version {version}, dtype code {code} is "
                              f"not an integer token index megalite reads (version 1, integer ids)")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc_index = struct.unpack("<QQ", head[18:34])
        if len(index) != 34 + 12 * n_seq + 8 * n_doc_index or n_doc_index < 1:
            raise ConfigError(f"'{idx_path(self.prefix)}' is {len(index)} bytes, not the "
                              f"{34 + 12 * n_seq + 8 * n_doc_index} its header gives: the index is "
                              f"truncated or damaged; prepare or copy the data again")
        lengths = np.frombuffer(index, np.int32, n_seq, 34)
        pointers = np.frombuffer(index, np.int64, n_seq, 34 + 4 * n_seq)
        doc_index = np.frombuffer(index, np.int64, n_doc_index, 34 + 12 * n_seq)
        size = bin_path(self.prefix).stat().st_size
        data_end = int(pointers[-1]) + int(lengths[-1]) * self.dtype.itemsize if n_seq else 0
        if size != data_end:
            # A half-copied .bin would otherwise read as documents of negative length.
            raise ConfigError(f"'{bin_path(self.prefix)}' is {size} bytes, but its index ends the "
                              f"data at byte {data_end}: the .bin is truncated or not this index's; "
                              f"prepare or copy the data again")
        self.tokens = np.memmap(bin_path(self.prefix), dtype=self.dtype, mode="r") if size \
            else np.zeros(0, self.dtype)
        self.n_docs = n_doc_index - 1
        self.n_tokens = len(self.tokens)
        end = self.n_tokens * self.dtype.itemsize
        # One sequence per document (megalite, and Megatron without sentence splitting): the
        # sequence pointers are the document starts, read in place. Sentence-split data: each
        # document starts at its first sequence (the end of the data for trailing empty ones).
        if n_seq == self.n_docs and _counts_up(doc_index):
            self._starts = pointers
        else:
            first = doc_index[:-1]
            self._starts = np.where(first < n_seq, pointers[np.minimum(first, max(n_seq - 1, 0))]
                                    if n_seq else end, end)

    def __len__(self) -> int:
        return self.n_docs

    def starts(self, docs: np.ndarray) -> np.ndarray:
        """The first token of each document in `docs`; `len(self)` gives the end of the data."""
        docs = np.asarray(docs, dtype=np.int64)
        inside = docs < self.n_docs
        out = np.full(docs.shape, self.n_tokens, dtype=np.int64)
        out[inside] = self._starts[docs[inside]] // self.dtype.itemsize
        return out

    def doc_of(self, positions: np.ndarray) -> np.ndarray:
        """The document each token position lies in (an empty document holds none: the search
        lands on the last document starting at or before the position, the one holding it)."""
        byte = np.asarray(positions, dtype=np.int64) * self.dtype.itemsize
        return np.searchsorted(self._starts, byte, side="right") - 1
