"""The sample order (a keyed bijection computed per position) and the held-out split (a bounded
number of runs): right at every size, random where it should be, and of constant state."""
import tracemalloc

import numpy as np
import pytest

from megalite.data import shuffle
from megalite.data.batches import BatchOrder
from megalite.data.blend import assign
from megalite.data.docs import HELD_OUT_RUNS, ArrayShard, TokenStore, held_out, held_out_ranges
from megalite.data.shuffle import key_of, permute

pytestmark = pytest.mark.unit

BINS, CHI2_LIMIT = 16, 400  # a 16 x 16 grid: ~225-255 degrees of freedom, so ~6 sigma


def test_a_bijection_at_every_small_n_and_at_large_ones():
    sizes = np.arange(1, 301)
    n, base = np.repeat(sizes, sizes), np.repeat(np.cumsum(sizes) - sizes, sizes)
    index = np.arange(len(n)) - base  # every n of 1..300 at once, each its own domain
    for seed in (0, 7):
        image = permute(index, n, key_of(seed, 0, 0))
        assert (image >= 0).all() and (image < n).all()
        assert np.array_equal(np.sort(image + base), np.arange(len(n)))  # each n's images: 0..n-1
    for n in (99_991, 2**17, 2**17 + 1):  # walks most, none, and a domain just under 2n
        assert np.array_equal(np.sort(permute(np.arange(n), n, key_of(3, 1, 0))), np.arange(n))


@pytest.mark.parametrize("n", [10**12, 2**40 + 3, 2**62])
def test_large_n_is_evaluated_pointwise_in_constant_memory(n):
    tracemalloc.start()
    image = permute(np.arange(1000) * (n // 1000), n, key_of(1, 2, 3))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20
    assert image.min() >= 0 and image.max() < n and len(np.unique(image)) == 1000
    assert np.array_equal(image[10:20], permute(np.arange(10, 20) * (n // 1000), n, key_of(1, 2, 3)))


def test_the_order_depends_on_every_part_of_the_key_and_only_on_it():
    n, index = 1000, np.arange(1000)
    keys = [key_of(1, 0, 0), key_of(2, 0, 0), key_of(1, 1, 0), key_of(1, 0, 1), key_of(0, 1, 1)]
    orders = [permute(index, n, k) for k in keys]
    assert np.array_equal(orders[0], permute(index, n, key_of(1, 0, 0)))
    for a in range(len(orders)):
        for b in range(a):
            assert (orders[a] == orders[b]).sum() < 10  # a uniform pair agrees at ~1 place
    assert key_of(1, 2)[0] != key_of(2, 1)[0]


def test_one_index_over_many_keys_lands_uniformly():
    epochs = np.arange(20_000)
    counts = np.bincount(permute(3, 10, key_of(7, epochs, 0)), minlength=10)
    assert ((counts - 2000) ** 2 / 2000).sum() < 40  # chi-square, 9 degrees of freedom


def grid_chi2(a: np.ndarray, b: np.ndarray, n: int) -> float:
    """Chi-square of the pairs (a, b) on a BINS x BINS grid against independent uniform values."""
    seen = np.bincount((a * BINS // n) * BINS + b * BINS // n, minlength=BINS * BINS)
    expected = len(a) / BINS**2
    return float(((seen - expected) ** 2 / expected).sum())


def looks_uniform(image: np.ndarray) -> bool:
    """Index and image independent, neighbouring images (a batch's rows) independent, and about
    one fixed point: what a uniform random permutation gives."""
    n, index = len(image), np.arange(len(image))
    return (grid_chi2(index, image, n) < CHI2_LIMIT and grid_chi2(image[:-1], image[1:], n) < CHI2_LIMIT
            and (image == index).sum() < 10)


def test_statistics_are_those_of_a_uniform_permutation_and_catch_broken_ones(monkeypatch):
    n = 100_003
    for seed in range(3):
        assert looks_uniform(permute(np.arange(n), n, key_of(seed, 0, 0)))
    assert not looks_uniform(np.arange(n))
    assert not looks_uniform((np.arange(n) + 21_131) % n)  # a rotation: no index correlation
    with monkeypatch.context() as m:
        m.setattr(shuffle, "ROUNDS", 2)
        assert not looks_uniform(permute(np.arange(n), n, key_of(1, 0, 0)))
    monkeypatch.setattr(shuffle, "mix64", lambda z: z)  # no mixing: still a bijection
    broken = permute(np.arange(n), n, key_of(1, 0, 0))
    assert np.array_equal(np.sort(broken), np.arange(n)) and not looks_uniform(broken)


def test_each_epoch_of_each_source_reads_every_sample_once():
    sizes, weights = [7, 13, 1], [0.3, 0.6, 0.1]
    order = BatchOrder(sizes, weights, global_batch=8, seed=5)
    positions = np.arange(200)
    picks = order.picks(positions)
    source, q = assign(positions, weights)
    assert np.array_equal(picks[:, 0], source)
    for s, n in enumerate(sizes):
        mine, epoch = picks[source == s, 1], q[source == s] // n
        epochs = [np.sort(mine[epoch == e]) for e in range(int(epoch.max()))]  # whole epochs
        assert len(epochs) >= 2 and all(np.array_equal(e, np.arange(n)) for e in epochs)
        if n > 2:
            assert not np.array_equal(mine[epoch == 0], mine[epoch == 1])
    assert np.array_equal(order.global_batch_picks(3), picks[24:32])


def old_held_out(n: int, fraction: float) -> np.ndarray:
    """The one-document-per-place split as it was before runs (its documents)."""
    n_val = min(max(int(round(fraction * n)), 1 if fraction > 0 else 0), n - 1) if n > 1 else 0
    return ((np.arange(n_val) + 0.5) * n / max(n_val, 1)).astype(np.int64)


def test_small_held_out_splits_are_exactly_the_old_documents():
    sizes = list(range(0, 60)) + [997, 1024, 1025, 2049, 10**5, 10**6 + 7]
    for n in sizes:
        for fraction in (0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 1.0):
            old = old_held_out(n, fraction)
            if len(old) <= HELD_OUT_RUNS:
                first, end = held_out_ranges(n, fraction)
                assert np.array_equal(first, old) and np.array_equal(end, old + 1), (n, fraction)


def test_large_held_out_splits_are_evenly_spread_runs_centred_on_the_old_documents():
    n, fraction = 10**7 + 3, 0.01
    old = old_held_out(n, fraction)
    first, end = held_out_ranges(n, fraction)
    length = end - first
    assert len(first) == HELD_OUT_RUNS and length.sum() == len(old) and np.ptp(length) <= 1
    runs_old = np.add.reduceat(old, np.concatenate([[0], np.cumsum(length)[:-1]])) / length
    assert np.abs((first + end - 1) / 2 - runs_old).max() <= 1


@pytest.mark.parametrize("n,fraction", [(10**9, 0.01), (10**10, 0.5), (2**62, 0.001), (2048, 0.5),
                                        (3001, 0.4), (5000, 0.9), (3000, 0.999)])
def test_held_out_runs_are_exact_disjoint_and_small_at_any_size(n, fraction):
    first, end = held_out_ranges(n, fraction)
    n_val = min(max(round(fraction * n), 1), n - 1)
    assert int((end - first).sum()) == n_val
    assert first.nbytes + end.nbytes <= 16 * HELD_OUT_RUNS and first[0] >= 0 and end[-1] <= n
    assert (first[1:] >= end[:-1]).all()  # sorted, never overlapping
    if 2 * n_val <= n:  # and then apart, with training documents before the first...
        assert (first[1:] > end[:-1]).all() and first[0] > 0
    if 2 * n_val < n:  # ...and after the last
        assert end[-1] < n


def test_held_out_splits_a_store_into_its_runs_and_the_rest():
    lengths = np.arange(5000) % 3 + 1
    shard = ArrayShard(np.arange(lengths.sum()) % 50, np.concatenate([[0], np.cumsum(lengths)]))
    store = TokenStore([shard])
    train, val = held_out(store, 0.2)
    first, end = held_out_ranges(5000, 0.2)
    assert (len(train), len(val)) == (4000, 1000) and len(first) == 1000  # one document a run
    train, val = held_out(store, 0.4)
    assert (len(train), len(val)) == (3000, 2000) and len(train.first) == HELD_OUT_RUNS + 1
    taken = np.zeros(5000, dtype=int)
    for docs in (train, val):
        for a, b in zip(docs.first, docs.end):
            taken[a:b] += 1
    assert (taken == 1).all() and train.n_tokens + val.n_tokens == lengths.sum()
