"""Small functions compiled where they run on CUDA, and plain elsewhere.

Eager PyTorch runs each elementwise op as its own kernel, a pass over memory each; compiled,
a chain of them over one tensor is one kernel. A model compiled whole gets that already (these
functions are then traced into its graph); an eager one gets it here, per function. On CPU they
stay plain: inductor's CPU build would cost each process seconds, and the CPU runs are the
exactness tests (tests/test_compiled.py compiles them on CPU to show them equal).
"""
import functools
from typing import Callable

import torch


@functools.cache
def compiled(fn: Callable, dynamic: bool | None = None) -> Callable:
    """fn compiled once per process (and `dynamic`, torch.compile's), on first use (importing
    megalite compiles nothing)."""
    return torch.compile(fn, dynamic=dynamic)


def fused(fn: Callable, device: torch.device) -> Callable:
    """fn compiled when it runs on CUDA outside a compiled region; fn itself otherwise."""
    return compiled(fn) if device.type == "cuda" and not torch.compiler.is_compiling() else fn
