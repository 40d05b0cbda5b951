"""Each communication primitive: forward and backward against values computed from every rank's data."""

import pytest

import torch
import torch.distributed as dist
from torch.testing import assert_close

from megalite.parallel import mappings as M
from megalite.parallel.state import ParallelState
from tests.support.harness import run_distributed


def rank_tensor(rank: int, shape, salt: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def forward_backward(primitive, x: torch.Tensor, grad: torch.Tensor, group):
    x = x.clone().requires_grad_()
    y = primitive(x, group)
    y.backward(grad)
    return y.detach(), x.grad


def check_mappings(*tps: int):
    for tp in tps:
        check_mappings_at(ParallelState.from_world(tp))


def check_mappings_at(ps: ParallelState):
    group, r, t = ps.tp_group, ps.tp_rank, ps.tp_size
    shape = (2, 4 * t, 3 * t)
    xs = [rank_tensor(i, shape, 1) for i in range(t)]
    gs = [rank_tensor(i, shape, 2) for i in range(t)]
    total = lambda ts: torch.stack(ts).sum(0)  # noqa: E731

    y, gx = forward_backward(M.copy_to_tensor_parallel_region, xs[r], gs[r], group)
    assert_close(y, xs[r]); assert_close(gx, total(gs))

    y, gx = forward_backward(M.reduce_from_tensor_parallel_region, xs[r], gs[r], group)
    assert_close(y, total(xs)); assert_close(gx, gs[r])

    shards = [gs[i].chunk(t, -1)[i] for i in range(t)]
    y, gx = forward_backward(M.scatter_to_tensor_parallel_region, xs[0], shards[r], group)
    assert_close(y, xs[0].chunk(t, -1)[r]); assert_close(gx, torch.cat(shards, -1))

    parts = [x.chunk(t, -1)[0] for x in xs]
    y, gx = forward_backward(M.gather_from_tensor_parallel_region, parts[r], gs[0], group)
    assert_close(y, torch.cat(parts, -1)); assert_close(gx, gs[0].chunk(t, -1)[r])

    grads = [g.chunk(t, 1)[0] for g in gs]
    y, gx = forward_backward(M.reduce_scatter_to_sequence_parallel_region, xs[r], grads[r], group)
    assert_close(y, total(xs).chunk(t, 1)[r]); assert_close(gx, torch.cat(grads, 1))


@pytest.mark.exactness
def test_mappings_two_ranks():
    run_distributed(check_mappings, 2, 2)


@pytest.mark.exactness
def test_mappings_four_ranks_in_tp_groups_of_four_and_two():
    run_distributed(check_mappings, 4, 4, 2)


@pytest.mark.unit
def test_a_single_rank_group_is_the_identity_without_autograd_node():
    x = torch.randn(2, 3, requires_grad=True)
    for name in ("copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
                 "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
                 "reduce_scatter_to_sequence_parallel_region"):
        assert getattr(M, name)(x, None) is x, name
    assert not dist.is_initialized()
