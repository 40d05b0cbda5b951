"""Samples, and the batches each DP rank reads at each step.

padded: a sample is one document (with its eos), truncated to seq_len + 1 tokens; a micro-batch
is padded with the pad id to its longest sample; labels are -100 at padding.
packed: the documents form one stream; sample k is stream[k T : k T + T + 1]. Every token carries
its document id: no attention across documents, positions restart, and the label that would
cross into the next document is -100.

The global batch of step k is a pure function of (seed, k): samples k G .. (k+1) G - 1 of an
endless sequence of seeded epoch permutations. DP rank d reads rows [d G/dp, (d+1) G/dp) of it,
in micro-batches. So the set of samples per step is the same for every layout, any step can be
read directly (resume mid-epoch needs only the step), and DP ranks read disjoint rows.
`Prefetcher` reads step k + 1's batches in a thread while the device runs step k.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Callable, Generic, Iterator, TypeVar

import numpy as np
import torch

from megalite.data.prepare import TokenDocs
from megalite.parallel.vocab import IGNORE_INDEX


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None

    def to(self, device: torch.device) -> "Batch":
        # From pinned memory the copy is truly asynchronous: the host does not wait for the
        # device to finish what it is running.
        source = self.pinned() if device.type == "cuda" else self
        return source._map(lambda t: t.to(device, non_blocking=True))

    def pinned(self) -> "Batch":
        """This batch in page-locked host memory (itself if it is there already)."""
        return self._map(lambda t: t if t.is_pinned() else t.pin_memory())

    def _map(self, fn) -> "Batch":
        return Batch(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                        for f in fields(self)})

    def target_count(self) -> torch.Tensor:
        """The real target tokens, as a tensor where the labels are (no host sync)."""
        return (self.labels != IGNORE_INDEX).sum()


class Samples:
    def __init__(self, docs: TokenDocs, mode: str, seq_len: int, pad_id: int):
        self.docs, self.mode, self.seq_len, self.pad_id = docs, mode, seq_len, pad_id
        lengths = np.diff(docs.offsets)
        if mode == "padded":
            # Every stored document ends with eos, so even a one-token document has a target.
            self.truncated = int((lengths > seq_len + 1).sum())
            self.count = len(docs)
        else:
            self.truncated = 0
            self.count = max(0, (len(docs.tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.count

    def collate(self, indices) -> Batch:
        return self._padded(indices) if self.mode == "padded" else self._packed(indices)

    def _padded(self, indices) -> Batch:
        rows = [self.docs.tokens[self.docs.offsets[i]: self.docs.offsets[i + 1]][: self.seq_len + 1]
                for i in indices]
        width = max(len(r) for r in rows) - 1
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, tokens in enumerate(rows):
            tokens = torch.from_numpy(tokens.astype(np.int64))
            n = len(tokens) - 1
            ids[row, :n], labels[row, :n], mask[row, :n] = tokens[:-1], tokens[1:], 1
        return Batch(ids, labels, attention_mask=mask)

    def _packed(self, indices) -> Batch:
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        window = starts[:, None] + np.arange(self.seq_len + 1)
        tokens = torch.from_numpy(self.docs.tokens[window].astype(np.int64))
        docs = torch.from_numpy(np.searchsorted(self.docs.offsets, window, side="right") - 1)
        labels = tokens[:, 1:].masked_fill(docs[:, 1:] != docs[:, :-1], IGNORE_INDEX)
        return Batch(tokens[:, :-1], labels, doc_ids=docs[:, :-1])


class BatchOrder:
    """Which samples form the global batch of each step, and which rows each DP rank reads."""

    def __init__(self, n_samples: int, global_batch: int, seed: int, shuffle: bool = True):
        self.n, self.global_batch, self.seed, self.shuffle = n_samples, global_batch, seed, shuffle
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            self._epochs = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)
                            if self.shuffle else np.arange(self.n)}
        return self._epochs[epoch]

    def global_batch_indices(self, step: int) -> np.ndarray:
        positions = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        return np.array([self._epoch(int(p // self.n))[p % self.n] for p in positions])

    def micro_batches(self, step: int, dp_rank: int, dp_size: int, micro: int) -> list[np.ndarray]:
        per_rank = self.global_batch // dp_size
        mine = self.global_batch_indices(step)[dp_rank * per_rank: (dp_rank + 1) * per_rank]
        return [mine[i: i + micro] for i in range(0, per_rank, micro)]


T = TypeVar("T")


class Prefetcher(Generic[T]):
    """Iterates (step, load(step)) over `steps`, computing load(step + 1) in a background thread
    while the caller works on step: a one-deep prefetch, so collating (and pinning) the next
    batches overlaps the device's work on this one.

        with Prefetcher(load, range(start, end)) as steps:
            for step, batches in steps: ...

    `load` must be a pure function of the step (the batch order is): what the loop sees is what
    it would load itself. An exception in `load` is raised by the iteration, in the caller's
    thread, at the step it was loading; leaving the `with` (a finished loop, a preemption, an
    error) waits for the load in flight, a collate of one step, and ends the thread.
    """

    def __init__(self, load: Callable[[int], T], steps: range):
        self.load, self.steps = load, steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-prefetch")

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __iter__(self) -> Iterator[tuple[int, T]]:
        pending = self._pool.submit(self.load, self.steps[0]) if self.steps else None
        for i, step in enumerate(self.steps):
            loaded = pending.result()
            if i + 1 < len(self.steps):
                pending = self._pool.submit(self.load, self.steps[i + 1])
            yield step, loaded
