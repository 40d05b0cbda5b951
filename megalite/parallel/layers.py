"""Megatron's two parallel linear layers (Shoeybi et al. 2019, section 3).

MLP: Y = GeLU(X A), Z = Y B. Split A by columns, A = [A_1 .. A_t]: rank r computes
Y_r = GeLU(f(X) A_r) with no communication (GeLU is element-wise). Split B by rows: rank r
computes Y_r B_r and g sums the partial products, Z = g(sum_r Y_r B_r). One all-reduce in
forward (g) and one in backward (f) per column/row pair.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel.init import Init, set_init
from megalite.parallel.mappings import (copy_to_tensor_parallel_region,
                                        gather_from_tensor_parallel_region,
                                        reduce_from_tensor_parallel_region,
                                        scatter_to_tensor_parallel_region)
from megalite.parallel.sharding import mark_sharded
from megalite.parallel.state import ParallelState


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by output columns; the input passes through f.

    `shards` < tp splits A into fewer slices than ranks: tp / shards consecutive ranks hold the
    same slice (GQA's KV heads when n_kv_heads < tp). Each copy sees only its own ranks' part
    of the gradient, so the weight passes through f over that block of ranks: the copies'
    gradients are summed and stay identical.

    `copy_input=False` when the caller already passed the input through f: several
    column-parallel layers that read the same input (Q and KV, SwiGLU's gate and up) share one
    f, hence one all-reduce in backward instead of one each.
    """

    def __init__(self, in_features: int, out_features: int, pstate: ParallelState, *,
                 bias: bool, init_std: float, gather_output: bool = False,
                 shards: int | None = None, copy_input: bool = True):
        super().__init__()
        shards = shards or pstate.tp_size
        copies = pstate.tp_size // shards
        if gather_output and copies > 1:
            raise ValueError("gather_output needs one slice per rank (shards == tp): with "
                             "copies, the gathered output would repeat columns")
        index = pstate.tp_rank // copies
        self.tp_group = pstate.tp_group
        self.replica_group = pstate.tp_subgroup(copies)
        self.gather_output = gather_output
        self.copy_input = copy_input
        local = out_features // shards
        self.weight = set_init(nn.Parameter(torch.empty(local, in_features, device=pstate.device)),
                               Init(std=init_std))
        mark_sharded(self.weight, 0, index, shards)
        self.bias = None
        if bias:
            self.bias = set_init(nn.Parameter(torch.empty(local, device=pstate.device)), Init())
            mark_sharded(self.bias, 0, index, shards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_parallel_region(self.weight, self.replica_group)
        bias = None if self.bias is None else copy_to_tensor_parallel_region(self.bias, self.replica_group)
        if self.copy_input:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        y = F.linear(x, weight, bias)
        return gather_from_tensor_parallel_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Z = X B + b with B split by input rows; partial products summed by g, then b added once."""

    def __init__(self, in_features: int, out_features: int, pstate: ParallelState, *,
                 bias: bool, init_std: float, input_is_parallel: bool = True):
        super().__init__()
        self.tp_group = pstate.tp_group
        self.input_is_parallel = input_is_parallel
        local = in_features // pstate.tp_size
        self.weight = set_init(nn.Parameter(torch.empty(out_features, local, device=pstate.device)),
                               Init(std=init_std))
        mark_sharded(self.weight, 1, pstate.tp_rank, pstate.tp_size)
        self.bias = None
        if bias:
            # Replicated and added after the reduce: added before it, it would count t times.
            self.bias = set_init(nn.Parameter(torch.empty(out_features, device=pstate.device)), Init())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        z = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.tp_group)
        return z if self.bias is None else z + self.bias
