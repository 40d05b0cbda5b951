"""Column-parallel layers that read the same X (Q and K/V, gate and up) as one matmul,
Y = X [A_1 A_2 ..], handed out in parts whose gradients backward takes part by part.

A part is one layer's output, or one matrix of an interleaved layer (K/V, fused per KV head as
[k_0, v_0, k_1, v_1, ..]: sharding.mark_interleaved) as [..., heads, size]. Plain autograd
would join the parts' gradients back into one [tokens, N_1 + N_2 + ..] tensor for the one
matmul's backward (a split's backward is a cat, an unbind's a stack: copies of the whole output
gradient, the profile's cat/stack layout copy). Here each part's gradient feeds its own
matmuls as it comes: dX = sum_i dY_i A_i accumulated in one buffer (addmm), dA_i = dY_i^T X.
The same FLOPs; the copies left are of the weights' size (an interleaved matrix's rows).
"""
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from megalite.parallel.mappings import SEQ_DIM, all_gather, reduce_scatter
from megalite.parallel.matmul import matmul_dtype

# Per layer: (its rows N_i, its interleave (parts, size) or None).
Layouts = Sequence[tuple[int, tuple[int, int] | None]]


def cut(t: torch.Tensor, layouts: Layouts, dim: int) -> Iterator[torch.Tensor]:
    """The parts of t along `dim` (views): a plain layer's N_i, or an interleaved one's
    matrices, each [.., N_i / (parts x size), size, ..]."""
    start = 0
    for rows, interleave in layouts:
        # One layer's whole output is t itself: a narrow's backward would copy its gradient.
        block = t if rows == t.shape[dim] else t.narrow(dim, start, rows)
        start += rows
        if interleave is None:
            yield block
        else:
            parts, size = interleave
            matrices = block.unflatten(dim, (rows // (parts * size), parts, size))
            yield from matrices.unbind(dim + 1 if dim >= 0 else dim - 1)  # the parts' dim


class LinearParts(torch.autograd.Function):
    """The parts of g(X) [A_1 A_2 ..] + [b_1 b_2 ..] (see the module): `group` None, X as it
    is; else X is this rank's sequence shard, all-gathered (SP's g: reduce-scattered backward)
    and stored as the shard, as layers.GatheredLinear does. The matmuls in the tensors' dtype
    (autocast's under autocast), as parallel/matmul.HIGH computes them. The parts are views of
    one output: autograd refuses an in-place op on them (use out-of-place ops after them)."""

    @staticmethod
    def forward(ctx, x, group, layouts: Layouts, *weights_and_biases):
        n = len(layouts)
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        ctx.group, ctx.layouts, ctx.input_dtype = group, layouts, x.dtype
        ctx.has_bias = biases[0] is not None
        # The matmul reads X in the autocast dtype anyway: the same values, half the store.
        x = x.to(matmul_dtype(x))
        ctx.save_for_backward(x, *weights)
        full = x if group is None else all_gather(x, SEQ_DIM, group)
        bias = torch.cat(biases) if ctx.has_bias else None
        return tuple(cut(F.linear(full, torch.cat(weights), bias), layouts, -1))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = x if ctx.group is None else all_gather(x, SEQ_DIM, ctx.group)
        tokens = full.reshape(-1, full.shape[-1])

        def parts(tensors):  # each layer's rows (dim 0) cut as its outputs are: views
            return (part for t, layout in zip(tensors, ctx.layouts) for part in cut(t, [layout], 0))

        # The weights' (and biases') gradients, written part by part into their rows.
        grad_w = [torch.empty(w.shape, dtype=grads[0].dtype, device=w.device) for w in weights]
        grad_b = [torch.empty(w.shape[0], dtype=grads[0].dtype, device=w.device) for w in weights]
        grad_x = None
        for grad, rows, into_w, into_b in zip(grads, parts(weights), parts(grad_w), parts(grad_b)):
            rows = rows.reshape(-1, rows.shape[-1])  # an interleaved matrix: a weight-sized copy
            grad = grad.reshape(tokens.shape[0], rows.shape[0])  # a copy only if not so laid out
            rows = rows.to(grad.dtype)
            grad_x = grad.mm(rows) if grad_x is None else grad_x.addmm_(grad, rows)
            if into_w.dim() == 2:  # a plain layer's whole gradient: made in place
                torch.mm(grad.t(), tokens.to(grad.dtype), out=into_w)
            else:  # one matrix of an interleaved layer: a weight-sized copy into its rows
                into_w.copy_(grad.t().mm(tokens.to(grad.dtype)).view_as(into_w))
            if ctx.has_bias:
                into_b.copy_(grad.sum(0).view_as(into_b))
        grad_x = grad_x.view(full.shape).to(ctx.input_dtype)
        if ctx.group is not None:
            grad_x = reduce_scatter(grad_x, SEQ_DIM, ctx.group)
        return grad_x, None, None, *grad_w, *(grad_b if ctx.has_bias else [None] * len(weights))
