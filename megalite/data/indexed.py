"""Megatron-LM's indexed dataset on disk: a `.bin` of token ids and an `.idx` that indexes it.

    .idx = b"MMIDIDX\\x00\\x00" | version <Q (1) | dtype code <B
           | sequence count <Q | document count <Q (documents + 1)
           | sequence lengths int32[sequences] | sequence pointers int64[sequences] (bytes into .bin)
           | document indices int64[documents + 1] (the first sequence of each document, then the end)

The same bytes `megatron.core.datasets.indexed_dataset` writes and reads (tests check both
directions against it), so data prepared for Megatron-LM trains here and ours trains there.
megalite writes one sequence per document (the text's tokens, then eos), as Megatron's
`preprocess_data.py --append-eod` does without sentence splitting.

Everything is memory-mapped: opening a shard allocates nothing that grows with its documents,
and a bounded number of shards is open at once (OPEN_SHARDS), whatever the corpus holds.
"""
import mmap
import os
import uuid
import struct
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from megalite.typed_config import ConfigError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's dtype codes of integer ids megalite reads (2, 3: int8, int16; 6, 7: floats)
DTYPE_CODES = {1: np.uint8, 4: np.int32, 5: np.int64, 8: np.uint16}
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


def targets_path(prefix: Path) -> Path:
    """megalite's side file of a shard of conversations: one byte per token of the .bin, 1 where
    the token is a target (what the assistant says), 0 where it is context only."""
    return prefix.with_name(prefix.name + ".targets")


def is_indexed(prefix: Path) -> bool:
    return idx_path(prefix).is_file() and bin_path(prefix).is_file()


class ShardWriter:
    """Appends documents to `<prefix>.bin`, then writes `<prefix>.idx`: both under temporary
    names, fsynced, until `finish`, so a killed run (or a lost machine) leaves no half shard
    that could be mistaken for one. A shard of no documents is not written at all (Megatron
    cannot map an empty .bin)."""

    def __init__(self, prefix: Path, dtype: np.dtype, targets: bool = False):
        """targets: also a side file of which tokens are targets (targets_path)."""
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        # (temporary name, name) of the .idx, the .bin, then the targets side file where one is
        # kept; the .idx is written whole by `finish`, the others as documents come
        names = [idx_path(prefix), bin_path(prefix)] + ([targets_path(prefix)] if targets else [])
        self._names = [(name.with_name(f".{name.name}.tmp"), name) for name in names]
        self._files = [open(tmp, "wb") for tmp, _ in self._names[1:]]
        self._lengths: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray, targets: np.ndarray | None = None) -> None:
        """Documents laid end to end in `tokens`, document i being `lengths[i]` long; with a
        targets side file, `targets[j]` says whether tokens[j] is a target."""
        if (targets is None) != (len(self._files) == 1) or (targets is not None and len(targets) != len(tokens)):
            raise ValueError("targets must be given for every token exactly when the writer keeps them")
        # the .bin's tokens, then the targets where the writer keeps them
        for f, data, dtype in zip(self._files, (tokens, targets), (self.dtype, np.uint8)):
            f.write(np.ascontiguousarray(data, dtype=dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))

    def finish(self) -> None:
        if not sum(len(block) for block in self._lengths):
            self.abandon()
            return
        for f in self._files:
            _close_synced(f)
        write_index(self._names[0][0], self.dtype, self._lengths)
        # The targets before the .bin, and both before the .idx, whose presence marks the shard whole.
        for tmp, name in reversed(self._names):
            os.replace(tmp, name)

    def abandon(self) -> None:
        for f, (tmp, _) in zip(self._files, self._names[1:]):
            f.close()
            tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: str | bytes) -> None:
    """`data` written under a temporary name, fsynced, then renamed `path`: a reader (or a
    killed run, or a lost machine) never sees half a file."""
    # A temporary name of its own (writers on several nodes may write the same file at once),
    # made with the umask's mode as any file (mkstemp's would be 0600).
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "xb" if isinstance(data, bytes) else "x") as f:
        f.write(data)
        _close_synced(f)
    os.replace(tmp, path)


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
    f.write(HEADER + struct.pack("<QBQQ", VERSION, TOKEN_DTYPES[np.dtype(dtype)], n, n + 1))
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


class IndexedShard:
    """One `.bin`/`.idx` pair, read in place. Documents are numbered 0..len-1 and their tokens
    lie end to end in the .bin (as every Megatron writer lays them): document d is
    tokens[starts(d) : starts(d + 1)], possibly empty (Megatron keeps empty documents).

    Made from the .idx header and the files' sizes alone (checked here, once), holding no file
    open: a corpus of thousands of shards costs no descriptor until read (`_LRU` bounds those open)."""

    def __init__(self, prefix: Path):
        self.prefix = Path(prefix)
        with open(idx_path(self.prefix), "rb") as f:
            head, index_size = f.read(34), os.fstat(f.fileno()).st_size
            if len(head) < 34 or head[:9] != HEADER:
                raise ConfigError(f"'{idx_path(self.prefix)}' is not a Megatron indexed dataset "
                                  f"index (no MMIDIDX header): give the prefix of a .bin/.idx pair")
            version, code, n_seq, n_doc_index = struct.unpack("<QBQQ", head[9:34])
            if version != VERSION or code not in DTYPE_CODES:
                raise ConfigError(f"'{idx_path(self.prefix)}': version {version}, dtype code {code} "
                                  f"is not an integer token index megalite reads (version 1, integer ids)")
            self.dtype = np.dtype(DTYPE_CODES[code])
            if index_size != 34 + 12 * n_seq + 8 * n_doc_index or n_doc_index < 1:
                raise ConfigError(f"'{idx_path(self.prefix)}' is {index_size} bytes, not the "
                                  f"{34 + 12 * n_seq + 8 * n_doc_index} its header gives: the index "
                                  f"is truncated or damaged; prepare or copy the data again")
            # The data ends where the last sequence does: its length and pointer, 12 bytes.
            data_end = 0 if not n_seq else \
                struct.unpack("<q", os.pread(f.fileno(), 8, 34 + 12 * n_seq - 8))[0] + \
                struct.unpack("<i", os.pread(f.fileno(), 4, 34 + 4 * n_seq - 4))[0] * self.dtype.itemsize
        size = bin_path(self.prefix).stat().st_size
        if size != data_end:
            # A half-copied .bin would otherwise read as documents of negative length.
            raise ConfigError(f"'{bin_path(self.prefix)}' is {size} bytes, but its index ends the "
                              f"data at byte {data_end}: the .bin is truncated or not this index's; "
                              f"prepare or copy the data again")
        self.n_seq, self.n_docs, self.n_tokens = n_seq, n_doc_index - 1, size // self.dtype.itemsize
        targets = targets_path(self.prefix)
        self.has_targets = targets.is_file()
        if self.has_targets and targets.stat().st_size != self.n_tokens:
            raise ConfigError(f"'{targets}' is {targets.stat().st_size} bytes, not one per token of "
                              f"'{bin_path(self.prefix)}' ({self.n_tokens}): the targets are truncated "
                              f"or not this shard's; prepare or copy the data again")

    def __len__(self) -> int:
        return self.n_docs

    @property
    def tokens(self) -> np.ndarray:
        """The .bin's token ids, mapped (a view held keeps its map until dropped)."""
        return _LRU.get(self).tokens

    @property
    def targets(self) -> np.ndarray | None:
        """The targets side file, mapped (None without one: every token is a target)."""
        return _LRU.get(self).targets

    def starts(self, docs: np.ndarray) -> np.ndarray:
        """The first token of each document in `docs`: its first sequence's, or the end of the
        data for `len(self)` and for an empty document after the last sequence."""
        docs = np.asarray(docs, dtype=np.int64)
        inside = np.flatnonzero(docs < self.n_docs)
        out = np.full(docs.shape, self.n_tokens, dtype=np.int64)
        if len(inside):  # (a shard none of `docs` is in is not opened: it costs no descriptor)
            maps = _LRU.get(self)
            first = maps.doc_index[docs.ravel()[inside]]
            has_seq = first < self.n_seq
            out.ravel()[inside[has_seq]] = maps.pointers[first[has_seq]] // self.dtype.itemsize
        return out

    def doc_of(self, positions: np.ndarray) -> np.ndarray:
        """The document each token position lies in: the sequence holding its byte, then the
        last document whose first sequence is at or before that one (an empty document holds
        none: the search lands on the last document starting at or before the position)."""
        maps = _LRU.get(self)
        seq = _search_right(maps.pointers, np.asarray(positions, dtype=np.int64) * self.dtype.itemsize) - 1
        return _search_right(maps.doc_index, seq) - 1


class _Maps:
    """A shard's .idx and .bin mapped, both index arrays searched in place (the module's note).
    One sequence per document (megalite's, and Megatron's without sentence splitting) makes the
    document index 0, 1, 2, ...; sentence-split data is read by the same two searches."""

    def __init__(self, shard: IndexedShard):
        n_seq, byte = shard.n_seq, np.dtype(np.uint8)
        # Each array keeps its map open (numpy holds its buffer) until the last view is dropped.
        index = _map(idx_path(shard.prefix), 34 + 12 * n_seq + 8 * (shard.n_docs + 1), byte)
        self.tokens = _map(bin_path(shard.prefix), shard.n_tokens, shard.dtype)
        self.targets = _map(targets_path(shard.prefix), shard.n_tokens, byte) if shard.has_targets else None
        self.pointers = np.frombuffer(index, np.int64, n_seq, 34 + 4 * n_seq)
        self.doc_index = np.frombuffer(index, np.int64, shard.n_docs + 1, 34 + 12 * n_seq)


def _search_right(a: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """np.searchsorted(a, keys, side="right") for `a` mapped from an index: numpy's would first
    copy all of `a` (read-only, and unaligned in the .idx), a pass over every document per
    call; this reads about log2(len(a)) elements per key."""
    keys = np.asarray(keys)
    lo, hi = np.zeros(keys.shape, np.int64), np.full(keys.shape, len(a), np.int64)
    open_ = np.flatnonzero(lo < hi)
    while len(open_):
        mid = (lo[open_] + hi[open_]) // 2
        right = a[mid] <= keys[open_]
        lo[open_[right]] = mid[right] + 1
        hi[open_[~right]] = mid[~right]
        open_ = open_[lo[open_] < hi[open_]]
    return lo


def _map(path: Path, n: int, dtype: np.dtype) -> np.ndarray:
    """`n` items of `dtype` mapped from `path` (an empty file cannot be mapped: none)."""
    if not n:
        return np.zeros(0, dtype)
    size = n * dtype.itemsize
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            raise ConfigError(f"'{path}' changed size since it was opened (now "
                              f"{os.fstat(f.fileno()).st_size} bytes, {size} before): the data "
                              f"was rewritten during the run; run again on data left in place")
        return np.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ), dtype)


class _OpenShards:
    """The maps of the shards read last, at most `limit` of them, for the whole process (every
    store and source shares the bound); the least recently read is closed to open another.
    Locked: batches are prefetched in a thread while the main one may read too."""

    def __init__(self, limit: int):
        self.limit, self.open, self.lock = limit, OrderedDict(), threading.Lock()

    def get(self, shard: IndexedShard) -> _Maps:
        """The shard's maps, opened if they are not."""
        with self.lock:
            found = self.open.pop(shard, None)
            while found is None and len(self.open) >= self.limit:
                self.open.popitem(last=False)  # unmapped and closed with its last user
            self.open[shard] = found or _Maps(shard)
            return self.open[shard]


# Each open shard holds 2 descriptors and 2 maps (3 with targets): 64 keeps a rank far below the usual
# `ulimit -n` of 1,024 and vm.max_map_count (65,530) whatever the corpus's shard count, while a
# batch spread over more shards only reopens some (a header read and two mmap calls each).
OPEN_SHARDS = 64
_LRU = _OpenShards(OPEN_SHARDS)
