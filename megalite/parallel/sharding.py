"""Which slice of a full weight a rank holds, recorded on the parameter itself.

A parameter without a `Shard` is replicated: every TP rank holds the whole tensor. A sharded one
holds slice `index` of `count` equal slices along `dim`. Usually count == tp; GQA with fewer KV
heads than TP ranks has count < tp, and tp / count consecutive ranks hold the same slice.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    dim: int
    index: int
    count: int

    def full_shape(self, local_shape: torch.Size) -> torch.Size:
        shape = list(local_shape)
        shape[self.dim] *= self.count
        return torch.Size(shape)

    def bounds(self, full_len: int) -> tuple[int, int]:
        """[start, stop) of this slice along `dim` of a tensor `full_len` long there."""
        size = full_len // self.count
        return self.index * size, (self.index + 1) * size

    def take(self, full: torch.Tensor) -> torch.Tensor:
        start, stop = self.bounds(full.shape[self.dim])
        return full.narrow(self.dim, start, stop - start)


def mark_sharded(param: torch.nn.Parameter, dim: int, index: int, count: int) -> torch.nn.Parameter:
    param.tp_shard = Shard(dim, index, count)
    return param


def shard_of(param: torch.Tensor) -> Shard | None:
    return getattr(param, "tp_shard", None)


def mark_expert_sharded(param: torch.nn.Parameter, index: int, count: int) -> None:
    """Experts stacked along dim 0, split over the EP group (replicated over TP)."""
    param.ep_shard = Shard(0, index, count)


def expert_shard_of(param: torch.Tensor) -> Shard | None:
    return getattr(param, "ep_shard", None)


def mark_interleaved(param: torch.nn.Parameter, parts: int, size: int) -> None:
    """param's dim 0 is blocks of `parts` fused matrices' rows, `size` rows each (the fused K/V
    weight [k_0, v_0, k_1, v_1, ...]): what Muon orthogonalises apart."""
    param.interleaved = (parts, size)


def interleaved_of(param: torch.Tensor) -> tuple[int, int] | None:
    return getattr(param, "interleaved", None)


def split_of(param: torch.Tensor) -> Shard | None:
    """The slice of the whole tensor that `param` is: TP's, or EP's for experts (never both)."""
    return shard_of(param) or expert_shard_of(param)


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor whose slice `param` holds (its own, if replicated)."""
    shard = split_of(param)
    return shard.full_shape(param.shape) if shard else param.shape


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of `full` (a weight, gradient or moment of param's shape) that this rank holds."""
    shard = split_of(param)
    return shard.take(full) if shard else full


def row_range(rows: int, index: int, count: int) -> tuple[int, int]:
    """Rows [start, stop) of a tensor's `rows` that member `index` of `count` replicas owns:
    contiguous, as even as they go (the first `rows % count` members take one more). The
    distributed optimizer's slice of a parameter and a checkpoint's writer share both use it."""
    base, extra = divmod(rows, count)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)
