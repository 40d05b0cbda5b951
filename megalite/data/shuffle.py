"""A keyed pseudo-random permutation of [0, n), evaluated pointwise: no table.

A materialised permutation costs 8 bytes per sample on every rank (80 GB at 1e10 samples) and
seconds per 1e7 to build; `permute` instead computes the image of each index on demand, a pure
function of (key, n, index) in O(1) memory. It is a Feistel network over [0, 2^k), 2^k the
smallest power of two >= n, whose halves have ceil(k/2) and floor(k/2) bits and trade places
each round (an even number of rounds restores the split), so odd k needs no wider domain.
Each round is a bijection whatever its round function, so the whole is one; images >= n are
walked on through the network until they land in [0, n) (cycle walking), which keeps it a
bijection of [0, n). Since 2^k < 2n, the walk averages under two passes per index: over the
indices of [0, n) the walks' lengths sum to at most 2^k, each domain element being passed once.
The round function is splitmix64's finaliser (a strong 64-bit mixer) of the half XOR a round
key. All arithmetic is on uint64 arrays, where numpy wraps silently as the mixer needs.
"""
import numpy as np

ROUNDS = 6  # even (the halves' widths are back in place); 4 already mixes well
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ROUND_STEPS = np.arange(1, ROUNDS + 1, dtype=np.uint64) * _GOLDEN  # an array: products wrap quietly
_ONE = np.uint64(1)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 in which every input bit moves every
    output bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def key_of(*parts) -> np.ndarray:
    """One uint64 key per element of the broadcast parts (ints or integer arrays), e.g.
    key_of(seed, epoch, source): order matters, and a change of any part changes the key."""
    parts = np.broadcast_arrays(*(np.atleast_1d(np.asarray(p)).astype(np.uint64) for p in parts))
    out = np.zeros(parts[0].shape, dtype=np.uint64)
    for p in parts:
        out = mix64((out + _GOLDEN) ^ p)
    return out


def permute(indices, n, key) -> np.ndarray:
    """The image of each index (in [0, n)) under the permutation of [0, n) named by `key`;
    indices, n and key broadcast together (each element may have its own n and key)."""
    indices, n, key = np.broadcast_arrays(np.asarray(indices, dtype=np.int64),
                                          np.asarray(n, dtype=np.int64), np.asarray(key, dtype=np.uint64))
    x = indices.ravel().astype(np.uint64)
    n, key = n.ravel().astype(np.uint64), key.ravel()
    bits = _bit_length(n - _ONE)
    low = bits // np.uint64(2)
    high = bits - low
    walk = np.arange(len(x))  # all once, then those still >= n
    while len(walk):
        x[walk] = _feistel(x[walk], high[walk], low[walk], key[walk])
        walk = walk[x[walk] >= n[walk]]
    return x.astype(np.int64).reshape(indices.shape)


def _feistel(x: np.ndarray, high: np.ndarray, low: np.ndarray, key: np.ndarray) -> np.ndarray:
    """ROUNDS rounds over [0, 2^(high + low)): (a, b) -> (b, a ^ F(b)), the widths swapping."""
    a, b, wa, wb = x >> low, x & _mask(low), high, low
    for r in range(ROUNDS):
        round_key = mix64(key + _ROUND_STEPS[r])
        a, b, wa, wb = b, a ^ (mix64(b ^ round_key) & _mask(wa)), wb, wa
    return (a << low) | b


def _mask(width: np.ndarray) -> np.ndarray:
    return (_ONE << width) - _ONE


def _bit_length(v: np.ndarray) -> np.ndarray:
    """Bits needed to write each v (0 for 0), exactly (a float log2 rounds near 2^53 and up)."""
    v, bits = v.copy(), np.zeros(v.shape, dtype=np.uint64)
    for s in map(np.uint64, (32, 16, 8, 4, 2, 1)):
        big = (v >> s) != 0
        v[big] >>= s
        bits[big] += s
    return bits + (v != 0).astype(np.uint64)
