"""CPU runs: each large tensor mapped from the OS and returned to it when freed.

glibc serves a block above its mmap threshold with its own mapping, but raises the threshold to
the size of each such block freed (up to 32 MiB), after which blocks of that size come from the
heap, whose free holes stay resident. A training step frees and makes tensors of every size
(activations, gradients, the distributed optimizer's buckets), so a rank's RSS grows past what
it holds: measured, the distributed optimizer peaked 241 MB above the replicated engine where
it holds 316 MB less (benchmarks/optimizer-memory). Setting the threshold fixes it, and stops
the adjustment. (GPU tensors are the CUDA caching allocator's: nothing to do there.)
"""
import ctypes
import ctypes.util
import platform

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 1 << 20  # 1 MiB: smaller blocks (most of a small model's) stay in the heap, as fast


def map_large_blocks() -> bool:
    """Fix glibc's mmap threshold (THRESHOLD) for this process; False where the C
    library is not glibc (nothing to do)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
