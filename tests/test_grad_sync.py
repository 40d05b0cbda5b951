"""Bucketed DP gradient sync (training/grads.py): parameters without a gradient on some rank or
micro-batch cannot deadlock the ranks; buckets follow backward order, one dtype each, up to the
cap; the settings are checked. (The synced gradients against the per-rank sums and one
process, with their all-reduces counted, and the norm: tests/test_tools_comm.py.)
"""
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megalite.parallel.state import ParallelState
from megalite.run_config import load_config
from megalite.plan import validate
from megalite.training.grads import DataParallelGradSync, bucket_params
from megalite.typed_config import ConfigError
from tests.support.harness import run_distributed


class PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.always = nn.Linear(4, 4)
        self.first_micro_batch_only = nn.Linear(4, 4)
        self.never = nn.Parameter(torch.ones(3))
        self.rank0_only = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, micro: int) -> torch.Tensor:
        y = self.always(x)
        if micro == 0:
            y = y + self.first_micro_batch_only(x)
        if dist.get_rank() == 0:
            y = y * self.rank0_only
        return y.square().sum()


def check_partly_used(ps: ParallelState, bucket_mb: float) -> None:
    torch.manual_seed(0)
    model = PartlyUsed()
    summed = PartlyUsed()
    summed.load_state_dict(model.state_dict())
    sync = DataParallelGradSync(model, ps, bucket_mb)
    x = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    for micro in range(2):
        with sync.last_micro_batch() if micro == 1 else nullcontext():
            model(x[micro], micro).backward()
        summed(x[micro], micro).backward()
    sync.wait()
    for name, p in model.named_parameters():
        expected = summed.get_parameter(name).grad
        expected = torch.zeros_like(p) if expected is None else expected
        dist.all_reduce(expected)
        assert torch.equal(p.grad, expected), name
    assert not model.never.grad.any()


def check_partly_used_in_buckets() -> None:
    ps = ParallelState.from_world(1)
    check_partly_used(ps, bucket_mb=1e-6)  # a bucket each
    check_partly_used(ps, bucket_mb=25.0)  # one bucket


@pytest.mark.exactness
def test_parameters_without_gradients_do_not_deadlock():
    run_distributed(check_partly_used_in_buckets, 2, timeout=60)


@pytest.mark.unit
def test_buckets_follow_backward_order_one_dtype_each_up_to_the_cap():
    f32, bf16 = torch.float32, torch.bfloat16
    sizes = [(10, f32), (300, f32), (20, bf16), (30, f32), (40, f32), (5, bf16)]
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in sizes]
    buckets = bucket_params(params, cap_bytes=400)
    # Last defined first; 40 + 30 floats fill 280 of 400 bytes, 300 floats pass the cap alone.
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b] for b in buckets] == [[5, 2], [4, 3], [1], [0]]


@pytest.mark.unit
def test_bucket_size_and_reduce_dtype_are_checked():
    assert load_config(None, []).parallel.dp_bucket_mb == 25.0
    with pytest.raises(ConfigError, match=r"parallel.dp_bucket_mb=0.0 must be > 0"):
        validate(load_config(None, ["parallel.dp_bucket_mb=0"]), 1)
    with pytest.raises(ConfigError, match="parallel.dp_reduce_dtype"):
        load_config(None, ["parallel.dp_reduce_dtype=fp16"])
