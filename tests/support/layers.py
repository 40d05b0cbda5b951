"""Layer-level helpers: the single-process state, seeded random tensors, and a parallel
layer built with the seeded init."""
import torch

from megalite.parallel.contexts import Contexts
from megalite.parallel.init import init_parameters_
from megalite.parallel.state import ParallelState


SINGLE = ParallelState()


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def build(cls, ps, *args, sequence_parallel: bool = False, **kwargs):
    """A layer on mesh `ps`, built with the TP context a model on it would give it."""
    layer = cls(*args, Contexts.of(ps, sequence_parallel, "all_gather").tp, **kwargs)
    init_parameters_(layer, seed=7)
    return layer
