"""Samples, and the batches each DP rank reads at each step.

padded: a sample is one document (with its eos), truncated to seq_len + 1 tokens; a micro-batch
is padded with the pad id to its longest sample; labels are -100 at padding.
packed: the documents form one stream; sample k is stream[k T : k T + T + 1]. Every token carries
its document id: no attention across documents, positions restart, and the label that would
cross into the next document is -100.

The global batch of step k is a pure function of (seed, k): positions k G .. (k+1) G - 1 of an
endless sequence of epochs, each a keyed permutation of the samples (shuffle.py: computed per
position, no table, so memory and start-up do not grow with the corpus); with a blend, each
position goes to a source by blend.py, and each source has its own epochs. DP rank d reads rows
[d G/dp, (d+1) G/dp) of it, in micro-batches. So the set of samples per step is the same for
every layout, any step can be read directly (resume mid-epoch needs only the step), and DP
ranks read disjoint rows.
`Prefetcher` reads step k + 1's batches in a thread while the device runs step k.
"""
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Callable, Generic, Iterator, TypeVar

import numpy as np
import torch

from megalite.data.blend import assign
from megalite.data.docs import DocSet
from megalite.data.shuffle import key_of, permute
from megalite.parallel.vocab import IGNORE_INDEX


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    source: torch.Tensor | None = None  # each row's source in a blend

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

    def target_count_per_source(self, n_sources: int) -> torch.Tensor:
        """The real target tokens of each source's rows (float: summed over ranks as is)."""
        per_row = (self.labels != IGNORE_INDEX).sum(dim=1).float()
        source = self.source if self.source is not None else torch.zeros_like(per_row, dtype=torch.long)
        return torch.zeros(n_sources, device=per_row.device).index_add_(0, source, per_row)


class Samples:
    """The samples of one document set: padded (one per document) or packed (stream windows)."""

    def __init__(self, docs: DocSet, mode: str, seq_len: int, pad_id: int, width_multiple: int = 1):
        """width_multiple: padded micro-batches are as wide as a multiple of it (context
        parallelism cuts rows into equal chunks; seq_len is one)."""
        self.docs, self.mode, self.seq_len, self.pad_id = docs, mode, seq_len, pad_id
        self.width_multiple = width_multiple

    def __len__(self) -> int:
        return len(self.docs) if self.mode == "padded" else max(0, (self.docs.n_tokens - 1) // self.seq_len)

    def rows(self, indices, targets: bool = False) -> list | None:
        """padded: each document's first seq_len + 1 tokens (every stored document ends with
        eos, so even a one-token document has a target). packed: (tokens, documents) of
        stream[k T : k T + T + 1] for each sample k. targets: whether each token of those rows
        is a target instead; None where every token is (data without a targets side file:
        documents, not conversations)."""
        if targets and not self.docs.store.has_targets:
            return None
        indices = np.asarray(indices, dtype=np.int64)
        if self.mode == "padded":
            return self.docs.documents(indices, self.seq_len + 1, targets)
        found = self.docs.window(indices * self.seq_len, self.seq_len + 1, targets)
        return list(found) if targets else list(zip(*found))

    def collate(self, indices) -> Batch:
        return collate(self.mode, self.rows(indices), self.pad_id, self.width_multiple,
                       self.rows(indices, targets=True))


def collate(mode: str, rows: list, pad_id: int, width_multiple: int = 1,
            targets: list | None = None) -> Batch:
    """targets: per row, whether each token is a target (None for a row, or for all: every
    token is); a token that is not gets label -100, as padding does."""
    if mode == "padded":
        # At least one column: a batch of one-token (or empty: Megatron keeps them) documents
        # has no targets, but still a shape. More padding at the end is exact: causal
        # attention hides it from every real token, and its labels are -100.
        width = max(1, max(len(r) for r in rows) - 1)
        width = -(-width // width_multiple) * width_multiple
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, tokens in enumerate(rows):
            tokens = torch.from_numpy(tokens.astype(np.int64))
            n = max(len(tokens) - 1, 0)
            ids[row, :n], labels[row, :n], mask[row, :n] = tokens[:n], tokens[1:], 1
        batch = Batch(ids, labels, attention_mask=mask)
    else:
        tokens = torch.from_numpy(np.stack([t for t, _ in rows]).astype(np.int64))
        docs = torch.from_numpy(np.stack([d for _, d in rows]))
        labels = tokens[:, 1:].masked_fill(docs[:, 1:] != docs[:, :-1], IGNORE_INDEX)
        batch = Batch(tokens[:, :-1], labels, doc_ids=docs[:, :-1])
    for row, target in enumerate(targets or []):
        if target is not None:
            n = min(len(target) - 1, batch.labels.shape[1])
            keep = torch.from_numpy(np.asarray(target[1:n + 1], dtype=bool))
            batch.labels[row, :n] = batch.labels[row, :n].masked_fill(~keep, IGNORE_INDEX)
    return batch


class Mixture:
    """Samples of several sources (a blend): a pick is (source, sample of that source); the
    batch's rows say their source, so each step can count the tokens it took from each."""

    def __init__(self, parts: list[Samples], weights: list[float]):
        self.parts, self.weights = parts, weights

    @property
    def sizes(self) -> list[int]:
        return [len(p) for p in self.parts]

    def leading_picks(self, count: int | None = None) -> np.ndarray:
        """(source, sample) picks for evaluation: every sample of every source once (count None),
        or about `count` in proportion to the weights, each source's first samples in order and
        none twice (a small source is not repeated)."""
        return np.concatenate([np.stack([np.full(t, s), np.arange(t)], axis=1)
                               for s, t in enumerate(self.leading_counts(count))]).astype(np.int64)

    def leading_counts(self, count: int | None = None) -> list[int]:
        """How many of each source's samples leading_picks(count) takes."""
        return self.sizes if count is None else [min(n, int(round(count * w)))
                                                 for n, w in zip(self.sizes, self.weights)]

    def nonempty(self) -> "Mixture":
        """The sources that have samples (a small held-out set may have none at seq_len)."""
        keep = [i for i, n in enumerate(self.sizes) if n]
        return Mixture([self.parts[i] for i in keep], [self.weights[i] for i in keep])

    def collate(self, picks: np.ndarray) -> Batch:
        picks = np.asarray(picks, dtype=np.int64).reshape(-1, 2)
        rows, targets = [None] * len(picks), [None] * len(picks)
        for s in np.unique(picks[:, 0]):
            where = np.flatnonzero(picks[:, 0] == s)
            part_rows = self.parts[s].rows(picks[where, 1])
            part_targets = self.parts[s].rows(picks[where, 1], targets=True) or [None] * len(where)
            for i, row, target in zip(where, part_rows, part_targets):
                rows[i], targets[i] = row, target
        first = self.parts[0]
        batch = collate(first.mode, rows, first.pad_id, first.width_multiple, targets)
        batch.source = torch.from_numpy(picks[:, 0].copy())
        return batch


# Checkpoints record it: a resume across a change of the order says so (train.resume).
SAMPLE_ORDER = 2  # 2: shuffle.py's keyed permutation


class BatchOrder:
    """Which samples form the global batch of each step, and which rows each DP rank reads.
    group_rows: samples come in groups of that many consecutive ones (a preference pair), which
    the order shuffles as one, so a group stays whole in a micro-batch (the objective's)."""

    def __init__(self, sizes: list[int], weights: list[float], global_batch: int, seed: int,
                 group_rows: int = 1):
        self.sizes, self.weights, self.global_batch, self.seed = sizes, weights, global_batch, seed
        self.group_rows = group_rows

    def picks(self, positions: np.ndarray) -> np.ndarray:
        """(source, group) for each global group position (a source's q-th is place q % n of
        its epoch q // n; a group is a sample where group_rows is 1)."""
        source, q = assign(np.asarray(positions, dtype=np.int64), self.weights)
        n = np.asarray(self.sizes, dtype=np.int64)[source] // self.group_rows
        return np.stack([source, permute(q % n, n, key_of(self.seed, q // n, source))], axis=1)

    def global_batch_picks(self, step: int) -> np.ndarray:
        k = self.group_rows
        groups = self.picks(np.arange(step * self.global_batch // k, (step + 1) * self.global_batch // k))
        rows = groups[:, None, :] * [1, k] + np.stack([np.zeros(k, np.int64), np.arange(k)], axis=1)
        return rows.reshape(-1, 2)

    def micro_batches(self, step: int, dp_rank: int, dp_size: int, micro: int) -> list[np.ndarray]:
        per_rank = self.global_batch // dp_size
        mine = self.global_batch_picks(step)[dp_rank * per_rank: (dp_rank + 1) * per_rank]
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
            pending = self._pool.submit(self.load, self.steps[i + 1]) if i + 1 < len(self.steps) else None
            yield step, loaded
