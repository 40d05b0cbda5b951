"""Which source each global sample position comes from, in exact proportion to the weights.

Source 0 takes position q of the stream iff floor((q + 1) w0) > floor(q w0): after any prefix
of n positions it holds floor(n w0) of them, within one sample of its share. The positions it
leaves form the stream of the remaining sources, split the same way with weights renormalised
over what remains, and so on. So every source's count after n positions is within a sample or
two of n x its weight at every n, and the assignment of a position is a pure, vectorised
function of the position: no table to build, cache or keep in step with resume. (Megatron's
BlendedDataset reaches the same bound with a greedy table it builds in C++ up front.)
"""
import numpy as np


def assign(positions: np.ndarray, weights: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """(source, index within that source's samples) of each position."""
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    source = np.full(positions.shape, len(w) - 1, dtype=np.int64)
    index = np.asarray(positions, dtype=np.int64).copy()
    where = np.arange(index.size)  # the positions no source has taken yet
    remaining = 1.0
    for s in range(len(w) - 1):
        share = min(1.0, w[s] / remaining)
        q = index[where]
        before, after = np.floor(q * share), np.floor((q + 1) * share)
        take = after > before
        source[where[take]] = s
        index[where] = np.where(take, before, q - after).astype(np.int64)
        where = where[~take]
        remaining -= w[s]
    return source, index
