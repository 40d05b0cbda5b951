"""Megatron's two parallel linear layers (Shoeybi et al. 2019, section 3).

MLP: Y = GeLU(X A), Z = Y B. Split A by columns, A = [A_1 .. A_t]: rank r computes
Y_r = GeLU(f(X) A_r) with no communication (GeLU is element-wise). Split B by rows: rank r
computes Y_r B_r and g sums the partial products, Z = g(sum_r Y_r B_r). One all-reduce in
forward (g) and one in backward (f) per column/row pair.

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) keeps X and Z split along the
sequence between the pairs: the SP paper's g all-gathers X before A (reduce-scatter backward),
and its g-bar reduce-scatters the partial products after B (all-gather backward): each
all-reduce becomes a reduce-scatter and an all-gather, the same bytes, plus one all-gather in
backward (GatheredLinear). In exchange the norms and dropouts around the pair run on 1/t of
the tokens and store 1/t of the activations.
"""
from typing import Sequence

import torch
from torch import nn

from megalite.parallel.init import new_param
from megalite.parallel.matmul import HIGH, Splits, matmul_dtype, shared_matmul
from megalite.parallel.mappings import (
    SEQ_DIM, all_gather, copy_to_tensor_parallel_region, gather_from_tensor_parallel_region,
    reduce_scatter, scatter_to_tensor_parallel_region)
from megalite.parallel.linear_parts import LinearParts, cut
from megalite.parallel.sharding import interleaved_of, mark_sharded
from megalite.parallel.contexts import TensorParallel


def column_parallel_linears(x: torch.Tensor, tp: TensorParallel,
                            *layers: tuple[torch.Tensor, torch.Tensor | None], matmul=HIGH,
                            splits: Splits | None = None,
                            interleaved: Sequence[tuple[int, int] | None] = ()
                            ) -> list[torch.Tensor]:
    """X A_i + b_i for each (A_i, b_i) of column-parallel layers that read the same X (Q and KV,
    SwiGLU's gate and up, or one layer; all with biases or none): X enters the TP region once
    for all of them, so backward sums its gradient over the ranks once, not once per layer.
    Their slices are one matmul, X [A_1 A_2 ..]: each rank's output columns are its own, so
    concatenating the slices it holds changes nothing of the split, and each layer keeps its
    own parameter (names, init, checkpoints, Hugging Face mapping). Several layers in the
    tensors' own precision take their gradients part by part (parallel/linear_parts.py).

    X replicated: through f (identity forward, all-reduce backward). X split along the sequence
    (tp.sharded, sequence parallelism): through the SP paper's g (all-gather forward, reduce-scatter
    backward), storing only this rank's shard for backward (GatheredLinear).

    matmul: the precision recipe (parallel/matmul.py); splits: its view of the operands (by
    default N split over TP, X's rows whole). interleaved: per layer, (parts, size) for a
    layer whose rows interleave `parts` matrices in blocks of `size` (K/V), handed out as one
    output each, [..., rows / (parts x size), size]; None (the default): the layer's output.
    """
    layouts = [(w.shape[0], i) for (w, _), i in zip(layers, interleaved or [None] * len(layers))]
    group, gathered = tp.group, tp.sharded
    weights, biases = zip(*layers)
    if len(layers) > 1 and matmul is HIGH:
        x = x if gathered else copy_to_tensor_parallel_region(x, group)
        return list(LinearParts.apply(x, group if gathered else None, layouts, *weights, *biases))
    # The layers' weights (and biases) as one matrix: [A_1 A_2 ..].
    weight = weights[0] if len(layers) == 1 else torch.cat(weights)
    bias = biases[0] if len(layers) == 1 or biases[0] is None else torch.cat(biases)
    splits = splits or Splits(outer=group)
    y = (GatheredLinear.apply(x, group, weight, bias, matmul, splits) if gathered
         else matmul.linear(copy_to_tensor_parallel_region(x, group), weight, bias, splits))
    # A scaled recipe (FP8) scales the whole output gradient at once: one matmul backward.
    return list(cut(y, layouts, -1))


def fused_column_parallel(x: torch.Tensor, *layers: "ColumnParallelLinear") -> list[torch.Tensor]:
    """column_parallel_linears of ColumnParallelLinear modules, each's A_r (and b_r), the
    precision recipe they share, and their interleaves (sharding.mark_interleaved)."""
    return column_parallel_linears(x, layers[0].tp, *(layer.weight_and_bias() for layer in layers),
                                   matmul=shared_matmul(layer.matmul for layer in layers),
                                   splits=layers[0].splits,
                                   interleaved=[interleaved_of(layer.weight) for layer in layers])


class GatheredLinear(torch.autograd.Function):
    """Y = g(X_r) A + b with g the all-gather of the sequence shards X_r (group None: no g,
    Y = X A + b, for a recipe's own matmul in the autograd graph: fp8/recipe.py).

    Autograd would store the gathered g(X_r), a whole [batch, seq, hidden] per layer on every
    rank: the very activation sequence parallelism splits. This stores X_r and gathers it again
    in backward, the trade Megatron-LM makes (one more all-gather per layer in backward).
    """

    @staticmethod
    def forward(ctx, x, group, weight, bias, matmul, splits):
        ctx.group, ctx.input_dtype, ctx.has_bias = group, x.dtype, bias is not None
        ctx.matmul, ctx.splits = matmul, splits
        # The matmul reads X in the autocast dtype anyway: casting the shard first halves
        # what is gathered and stored, and gives the same values.
        x = x.to(matmul_dtype(x))
        ctx.save_for_backward(x, weight)
        full = x if group is None else all_gather(x, SEQ_DIM, group)
        return matmul.forward(full, weight, bias, splits)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = x if ctx.group is None else all_gather(x, SEQ_DIM, ctx.group)
        # The input gradient in the matmul's dtype, reduced in X's (fp32 under autocast), as
        # autograd and f do without sequence parallelism.
        grad_x = ctx.matmul.grad_input(grad, weight, ctx.splits).to(ctx.input_dtype)
        if ctx.group is not None:
            grad_x = reduce_scatter(grad_x, SEQ_DIM, ctx.group)
        grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = ctx.matmul.grad_weight(grad, full.reshape(-1, full.shape[-1]), ctx.splits)
        return grad_x, None, grad_weight, grad.sum(0) if ctx.has_bias else None, None, None


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by output columns; the input passes through f (or, sequence
    parallel, the SP paper's g: column_parallel_linears).

    `shards` < tp splits A into fewer slices than ranks: tp / shards consecutive ranks hold the
    same slice (GQA's KV heads when n_kv_heads < tp). Each copy sees only its own ranks' part
    of the gradient, so the weight passes through f over that block of ranks: the copies'
    gradients are summed and stay identical.

    Several layers that read the same input (Q and KV, SwiGLU's gate and up) call
    column_parallel_linears with their weight_and_bias() instead of forward: one f for all.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *,
                 bias: bool, init_std: float, gather_output: bool = False,
                 shards: int | None = None):
        super().__init__()
        shards = shards or tp.size
        copies = tp.size // shards
        if gather_output and copies > 1:
            raise ValueError("gather_output needs one slice per rank (shards == tp): with "
                             "copies, the gathered output would repeat columns")
        index = tp.rank // copies
        self.tp, self.matmul = tp, HIGH
        self.splits = Splits(tp.token_groups, outer=tp.group)
        # Each copy's output gradient is a part of the whole (its ranks' heads'): a recipe that
        # scales by the whole gradient (FP8) could not equal one process (fp8/convert.py).
        self.partial_output_grad = (f"its slice is held by {copies} TP ranks, each with its own "
                                    f"heads' part of the gradient") if copies > 1 else None
        self.replica_group = tp.blocks(copies) if copies > 1 else None
        self.gather_output = gather_output
        local = out_features // shards
        self.weight = new_param(local, in_features, std=init_std)
        mark_sharded(self.weight, 0, index, shards)
        self.bias = mark_sharded(new_param(local), 0, index, shards) if bias else None

    def weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(A_r, b_r) as the matmul reads them: a slice held by copies passes through f over them."""
        return tuple(None if p is None else copy_to_tensor_parallel_region(p, self.replica_group)
                     for p in (self.weight, self.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, = fused_column_parallel(x, self)
        return gather_from_tensor_parallel_region(y, self.tp.group) if self.gather_output else y

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """X A_r alone, for an input already in the TP region (no f, no bias)."""
        return self.matmul.linear(x, self.weight, None, self.splits)


class RowParallelLinear(nn.Module):
    """Z = X B + b with B split by input rows; partial products summed by g, then b added once.

    Sequence parallel: summed by the SP paper's g-bar into this rank's sequence shard of Z, and b,
    added to that shard only, has its gradient summed over TP."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *,
                 bias: bool, init_std: float, input_is_parallel: bool = True):
        super().__init__()
        self.tp, self.input_is_parallel, self.matmul = tp, input_is_parallel, HIGH
        self.splits = Splits(tp.token_groups, inner=tp.group)
        self.weight = new_param(out_features, in_features // tp.size, std=init_std)
        mark_sharded(self.weight, 1, tp.rank, tp.size)
        # Replicated and added after the reduce: added before it, it would count t times.
        self.bias = new_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp.group)
        z = self.tp.reduce(self.matmul.linear(x, self.weight, None, self.splits))
        return z if self.bias is None else z + self.tp.sum_grad(self.bias)