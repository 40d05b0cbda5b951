"""Communication primitives of tensor (and sequence) parallelism, as autograd functions.

Named as in Megatron-LM's `tensor_parallel/mappings.py`. Each is a pair of collectives, one for
forward and its adjoint for backward. The operator names are Megatron-LM's (Shoeybi et al.
2019: f, g), then the sequence-parallel paper's (Korthikanti et al. 2022, figures 4 and 5, which
call Megatron-LM's g "f-bar"):

| primitive                           | forward            | backward          | paper |
|-------------------------------------|--------------------|-------------------|-------|
| copy_to_tensor_parallel_region      | identity           | all-reduce        | f     |
| reduce_from_tensor_parallel_region  | all-reduce         | identity          | g (SP paper: f-bar) |
| scatter_to_tensor_parallel_region   | split last dim     | all-gather last   |       |
| gather_from_tensor_parallel_region  | all-gather last    | split last dim    |       |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter | all-gather seq | SP paper: g-bar |
| gather_from_sequence_parallel_region | all-gather seq   | reduce-scatter    | SP paper: g |
| all_to_all (expert parallelism)     | rows to ranks      | rows back         |       |

Activations are [batch, seq, hidden], so the sequence dim is 1. A group of None or of size 1
makes every primitive the identity, with no autograd node and no collective. The model applies
the SP paper's g fused with the column-parallel matmuls after it (layers.py), so that backward
keeps the shard rather than the gathered input; gather_from_sequence_parallel_region serves the
LM head + loss, which keeps nothing of its input for backward when training.
"""
import torch
import torch.distributed as dist

SEQ_DIM = 1


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_over(x: torch.Tensor, *groups, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """x reduced in place over each group in turn (not autograd: for statistics and norms);
    groups of one rank, or None, are skipped."""
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(x, op=op, group=group)
    return x


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # Out of place: autograd may hand the same gradient tensor to several branches (an add
    # passes one tensor to both inputs), so reducing it in place would corrupt the others.
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (no autograd)."""
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's chunk of the sum along `dim` (no autograd)."""
    parts = [p.contiguous() for p in x.chunk(group_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x.view_as(x)


def primitive(name: str, forward, backward):
    """An autograd function whose forward is forward(x, group, *args) and backward
    backward(grad, group, *args), args being what the call passes after the group.

    A group of None or of size 1 makes it the identity, with no autograd node.
    """

    class Primitive(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, *args):
            ctx.group, ctx.args = group, args
            return forward(x, group, *args)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group, *ctx.args), None, *(None for _ in ctx.args)

    Primitive.__name__ = Primitive.__qualname__ = name

    def apply(x: torch.Tensor, group, *args) -> torch.Tensor:
        return x if group_size(group) == 1 else Primitive.apply(x, group, *args)

    apply.__name__ = apply.__qualname__ = name
    return apply


def along(collective, dim: int):
    """collective(x, dim, group) along a fixed dim, as f(x, group)."""
    return lambda x, group: collective(x, dim, group)


def _split_last(x, group):
    return x.chunk(group_size(group), dim=-1)[dist.get_rank(group)].contiguous()


# name                                     forward                  backward
copy_to_tensor_parallel_region = primitive(
    "copy_to_tensor_parallel_region",      _identity,               _all_reduce)
reduce_from_tensor_parallel_region = primitive(
    "reduce_from_tensor_parallel_region",  _all_reduce,             _identity)
scatter_to_tensor_parallel_region = primitive(
    "scatter_to_tensor_parallel_region",   _split_last,             along(all_gather, -1))
gather_from_tensor_parallel_region = primitive(
    "gather_from_tensor_parallel_region",  along(all_gather, -1),   _split_last)
reduce_scatter_to_sequence_parallel_region = primitive(
    "reduce_scatter_to_sequence_parallel_region",
    along(reduce_scatter, SEQ_DIM), along(all_gather, SEQ_DIM))
gather_from_sequence_parallel_region = primitive(
    "gather_from_sequence_parallel_region",
    along(all_gather, SEQ_DIM), along(reduce_scatter, SEQ_DIM))
# Each rank's share of a sum that every rank then uses whole (a row's log-probability over its
# CP shares): the gradient of a share is the sum of every rank's gradient of the whole.
sum_shares = primitive("sum_shares",       _all_reduce,             _all_reduce)


def _all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


# all_to_all(x, group, output_splits, input_splits): rows of x to the group's ranks: the first
# input_splits[0] to rank 0, and so on; rank r's rows for this rank arrive in its order,
# output_splits[r] of them. Backward sends the gradients back the same way (uneven splits,
# zero rows included).
all_to_all = primitive("all_to_all", _all_to_all,
                       lambda grad, group, outputs, inputs: _all_to_all(grad, group, inputs, outputs))
