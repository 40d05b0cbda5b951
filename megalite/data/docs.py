"""Documents of token ids, read in place from one or more shards.

`TokenStore` joins shards end to end: document and token numbers run on across shard
boundaries, so the same documents give the same store however they were sharded (one Megatron
file, or many megalite shards). `DocSet` is a subset of a store's documents, as sorted ranges
(the training split, the held-out split): it reads documents by number, or windows of its own
token stream (its documents joined, each followed by eos) for packed rows. Nothing here loops
over documents in Python: every lookup is a vectorised search over the shards' indexes.
"""
from dataclasses import dataclass

import numpy as np

from megalite.data.indexed import IndexedShard


@dataclass
class ArrayShard:
    """Documents held in memory (data.path=synthetic, benchmarks, tests): `offsets[d]` is where
    document d starts."""

    tokens: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray | None = None  # per token, as IndexedShard.targets

    def __post_init__(self):
        self.n_tokens, self.dtype = int(self.offsets[-1]), self.tokens.dtype
        self.has_targets = self.targets is not None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def starts(self, docs: np.ndarray) -> np.ndarray:
        return self.offsets[np.asarray(docs, dtype=np.int64)]

    def doc_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, positions, side="right") - 1


class TokenStore:
    """Shards end to end. Built from each shard's counts alone (an IndexedShard's come from its
    header): a shard's files are opened only when a lookup needs its documents."""

    def __init__(self, shards: list[IndexedShard | ArrayShard]):
        self.shards = shards
        self.doc_base = np.concatenate([[0], np.cumsum([len(s) for s in shards])]).astype(np.int64)
        self.token_base = np.concatenate([[0], np.cumsum([s.n_tokens for s in shards])]).astype(np.int64)
        # Whether any shard says which tokens are targets (conversations); without, all are.
        self.has_targets = any(s.has_targets for s in shards)

    @property
    def n_docs(self) -> int:
        return int(self.doc_base[-1])

    def starts(self, docs: np.ndarray) -> np.ndarray:
        """Global first token of each global document (n_docs: the end of the store)."""
        docs = np.asarray(docs, dtype=np.int64).ravel()
        shard = np.clip(np.searchsorted(self.doc_base, docs, side="right") - 1, 0, len(self.shards) - 1)
        local = docs - self.doc_base[shard]
        # A shard's first document starts at its first token, and the end of a shard is the
        # next one's start: range bounds (DocSet's) need no shard opened.
        end = local >= self.doc_base[shard + 1] - self.doc_base[shard]
        out = np.where(end, self.token_base[shard + 1], self.token_base[shard])
        inner = np.flatnonzero((local > 0) & ~end)
        for s, here in _by_shard(shard[inner]):
            out[inner[here]] += self.shards[s].starts(local[inner[here]])
        return out

    def read(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token id, global document) at each global token position."""
        tokens, docs = np.empty((2, np.size(positions)), dtype=np.int64)
        for s, here, local in self._by_shard(positions):
            tokens[here] = self.shards[s].tokens[local]
            docs[here] = self.doc_base[s] + self.shards[s].doc_of(local)
        return tokens.reshape(np.shape(positions)), docs.reshape(np.shape(positions))

    def read_targets(self, positions: np.ndarray) -> np.ndarray:
        """Whether the token at each global position is a target (True where its shard has no
        targets side file)."""
        out = np.ones(np.size(positions), dtype=bool)
        for s, here, local in self._by_shard(positions):
            targets = self.shards[s].targets
            if targets is not None:
                out[here] = targets[local] != 0
        return out.reshape(np.shape(positions))

    def _by_shard(self, positions: np.ndarray):
        """(shard, the indices of the flattened positions in it, their positions in it)."""
        flat = np.asarray(positions, dtype=np.int64).ravel()
        for s, here in _by_shard(np.searchsorted(self.token_base, flat, side="right") - 1):
            yield s, here, flat[here] - self.token_base[s]


def _by_shard(shard: np.ndarray):
    """(shard, the indices of `shard` that name it) for each shard named: one sort, so the cost
    grows with the lookups, not with lookups x shards."""
    order = np.argsort(shard, kind="stable")
    bounds = np.flatnonzero(np.diff(shard[order])) + 1
    for here in np.split(order, bounds) if len(order) else []:
        yield int(shard[here[0]]), here


class DocSet:
    """Documents [first[k], end[k]) of `store`, for each range k in order."""

    def __init__(self, store: TokenStore, first: np.ndarray, end: np.ndarray):
        keep = end > first
        self.store, self.first, self.end = store, first[keep], end[keep]
        self.doc_base = np.concatenate([[0], np.cumsum(self.end - self.first)]).astype(np.int64)
        self.tok_first, self.tok_end = store.starts(self.first), store.starts(self.end)
        self.token_base = np.concatenate([[0], np.cumsum(self.tok_end - self.tok_first)]).astype(np.int64)

    @classmethod
    def whole(cls, store: TokenStore) -> "DocSet":
        return cls(store, np.array([0]), np.array([store.n_docs]))

    def __len__(self) -> int:
        return int(self.doc_base[-1])

    @property
    def n_tokens(self) -> int:
        return int(self.token_base[-1])

    def no_longer_than(self, limit: int) -> "DocSet":
        """The documents of at most `limit` tokens, in order (their ranges: a pass over every
        document's length, a table as long as the set)."""
        kept = self._global_docs(np.flatnonzero(self.lengths(np.arange(len(self))) <= limit))
        # Runs of consecutive documents: one starts (ends) where the step from the previous
        # (to the next) is not 1; -2 and kept[-1] + 2 make the ends of `kept` such steps.
        first = kept[np.diff(kept, prepend=-2) != 1]
        end = kept[np.diff(kept, append=kept[-1:] + 2) != 1] + 1
        return DocSet(self.store, first, end)

    def _global_docs(self, docs: np.ndarray) -> np.ndarray:
        docs = np.asarray(docs, dtype=np.int64)
        k = np.searchsorted(self.doc_base, docs, side="right") - 1
        return self.first[k] + docs - self.doc_base[k]

    def lengths(self, docs: np.ndarray) -> np.ndarray:
        g = self._global_docs(docs)
        return self.store.starts(g + 1) - self.store.starts(g)

    def documents(self, docs, limit: int, targets: bool = False) -> list[np.ndarray]:
        """The first `limit` tokens of each document in `docs` (targets: whether each is a
        target, instead)."""
        g = self._global_docs(docs)
        starts = self.store.starts(g)
        ends = np.minimum(self.store.starts(g + 1), starts + limit)
        width = int((ends - starts).max()) if len(g) else 0
        # Short (and empty) documents repeat a token of their own, or the store's last, to fill
        # the rectangle; each row is cut back to its length.
        last = np.minimum(np.maximum(ends - 1, starts), max(int(self.store.token_base[-1]) - 1, 0))
        window = np.minimum(starts[:, None] + np.arange(width), last[:, None])
        rows = self.store.read_targets(window) if targets else self.store.read(window)[0]
        return [row[: e - s] for row, s, e in zip(rows, starts, ends)]

    def window(self, starts: np.ndarray, length: int, targets: bool = False):
        """Rows of `length` tokens of this set's stream from each start: (tokens, document),
        documents numbered by the store, so a change of number is a document boundary
        (targets: whether each token is a target, instead)."""
        stream = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length)
        k = np.searchsorted(self.token_base, stream, side="right") - 1
        positions = self.tok_first[k] + stream - self.token_base[k]
        return self.store.read_targets(positions) if targets else self.store.read(positions)


# Held-out runs at most: the split's state stays a few KB at any corpus size, and a thousand
# evenly spread places sample the whole corpus (its sources, shards, dates) about as well as
# one document per place.
HELD_OUT_RUNS = 1024


def held_out(store: TokenStore, fraction: float) -> tuple["DocSet", "DocSet"]:
    """(train, val): the documents `held_out_ranges` holds out for validation, and the rest."""
    n = store.n_docs
    first, end = held_out_ranges(n, fraction)
    train = DocSet(store, np.concatenate([[0], end]), np.concatenate([first, [n]]))
    return train, DocSet(store, first, end)


def held_out_ranges(n: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The held-out documents of n as sorted, disjoint ranges [first[k], end[k]).

    n_val = round(fraction x n) (at least one when the fraction is positive and n > 1, at most
    n - 1) documents in R = min(n_val, HELD_OUT_RUNS) runs: run k holds places j in
    [k n_val // R, (k + 1) n_val // R) of the one-document-per-place split (place j at document
    floor((j + 0.5) n / n_val)), as one contiguous run centred on those documents' mean. With
    n_val <= HELD_OUT_RUNS every run is one place: exactly the one-document-per-place split.
    Runs never overlap; with at most half the documents held out they never touch either, and
    with fewer than half neither corpus end is held out (the training split is R + 1 ranges).
    """
    n = int(n)
    n_val = min(max(int(round(fraction * n)), 1 if fraction > 0 else 0), n - 1) if n > 1 else 0
    runs = min(n_val, HELD_OUT_RUNS)
    if runs == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    # Python ints (object arrays of R + 1): n x n_val overflows int64 past ~3e9 documents.
    place = np.arange(runs + 1).astype(object) * n_val // runs
    length = place[1:] - place[:-1]
    first = ((place[:-1] + place[1:]) * n - (length - 1) * n_val) // (2 * n_val)
    return first.astype(np.int64), (first + length).astype(np.int64)
