"""Bucketed DP gradient sync and the foreach gradient norm (training/grads.py).

With buckets far smaller than the model (a parameter larger than one among them) and two
accumulation micro-batches per step, the synced gradients are exactly the per-rank gradients
summed one parameter at a time, and the single-process gradients to fp32 rounding, at TP1xDP2
and TP2xDP2; a bf16 reduction is within bf16 rounding; there is one DP all-reduce per bucket;
parameters without a gradient on some rank or micro-batch cannot deadlock the ranks. The norm
equals the plain norm of the full gradients.
"""
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from bench.comm import CommLog
from megalite.model import GPT
from megalite.parallel.sharding import shard_of
from megalite.parallel.state import ParallelState
from megalite.run_config import load_config
from megalite.run_setup import validate
from megalite.training.grads import MIB, DataParallelGradSync, bucket_params, clip_grad_norm_
from megalite.typed_config import ConfigError, replaced
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, gather_full, padded_batch

# GQA with one KV head at TP2: the KV weights are slices held by 2 copies, which the norm
# counts once.
GQA = replaced(CONFIGS["gpt2"], "attention.n_kv_heads", 1)
# 1500 fp32 elements: the 128 x 32 embedding (a 64 x 32 slice at TP2) is larger than a bucket.
BUCKET_MB = 6000 / MIB
LENGTHS = (12, 7, 3, 10, 5, 9, 11, 4)  # 2 micro-batches of 2 rows per DP rank at DP2


def backward_step(model: GPT, sync, rows: slice, step: int) -> None:
    """One step's backward over `rows` of the global batch, in 2 micro-batches."""
    ids, _, labels = padded_batch(GQA, "right", LENGTHS, seed=step)
    n_tokens = (labels != -100).sum()
    micro = list(zip(ids[rows].chunk(2), labels[rows].chunk(2)))
    for i, (x, y) in enumerate(micro):
        loss = model(x, labels=y).token_losses.sum() / n_tokens
        with sync.last_micro_batch() if sync and i == len(micro) - 1 else nullcontext():
            loss.backward()
    if sync:
        sync.wait()


def check_bucketed_sync(ps: ParallelState, reduce_dtype: str) -> None:
    per_rank = len(LENGTHS) // ps.dp_size
    rows = slice(ps.dp_rank * per_rank, (ps.dp_rank + 1) * per_rank)
    model, summed = GPT(GQA, ps, seed=0), GPT(GQA, ps, seed=0)
    single = GPT(GQA, ParallelState(), seed=0)
    sync = DataParallelGradSync(model, ps, BUCKET_MB, reduce_dtype)
    assert len(sync.buckets) >= 5
    assert any(len(b.params) == 1 and b.buffer.numel() * 4 > BUCKET_MB * MIB for b in sync.buckets)
    single_params = dict(single.named_parameters())
    for step in range(2):  # the second reuses the buckets after zero_grad(set_to_none=True)
        # The first step's all-reduces are counted (and made synchronous); the second overlaps.
        with CommLog(ps) if step == 0 else nullcontext() as log:
            backward_step(model, sync, rows, step)
        if log:
            dp_calls = [r for r in log.records if r["op"] == "all_reduce" and r["group"] == "dp"]
            assert len(dp_calls) == len(sync.buckets)
        backward_step(summed, None, rows, step)
        backward_step(single, None, slice(None), step)
        for name, p in model.named_parameters():
            expected = summed.get_parameter(name).grad
            magnitude = expected.abs()
            dist.all_reduce(expected, group=ps.dp_group)
            dist.all_reduce(magnitude, group=ps.dp_group)
            full = gather_full(p.grad, shard_of(p), ps)
            if reduce_dtype == "fp32":
                assert torch.equal(p.grad, expected), name
                assert_close(full, single_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)
            else:
                # Each rank's gradient and their sum rounded to bf16 (unit roundoff 2^-8).
                assert torch.equal(p.grad, p.grad.bfloat16().float()), name
                assert ((p.grad - expected).abs() <= 2**-7 * magnitude).all(), name
        for m in (model, summed, single):
            m.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())


def check_norm(ps: ParallelState) -> None:
    model = GPT(GQA, ps, seed=0)
    backward_step(model, DataParallelGradSync(model, ps), slice(None), step=0)
    full = [gather_full(p.grad, shard_of(p), ps) for p in model.parameters()]
    plain = torch.sqrt(sum(g.double().square().sum() for g in full)).float()
    norm = clip_grad_norm_(model, 0.0, ps)
    assert_close(norm, plain, atol=0, rtol=2e-6)
    clip_grad_norm_(model, 0.5 * norm.item(), ps)
    assert_close(clip_grad_norm_(model, 0.0, ps), 0.5 * norm, atol=0, rtol=1e-5)


def check_layout(tp: int) -> None:
    ps = ParallelState.from_world(tp)
    check_bucketed_sync(ps, "fp32")
    check_bucketed_sync(ps, "bf16")
    check_norm(ps)


@pytest.mark.parametrize("tp,world", [(1, 2), (2, 4)], ids=["tp1xdp2", "tp2xdp2"])
def test_bucketed_sync_sums_gradients_and_the_norm_is_the_full_one(tp, world):
    run_distributed(check_layout, world, tp)


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


def test_parameters_without_gradients_do_not_deadlock():
    run_distributed(check_partly_used_in_buckets, 2, timeout=60)


def test_buckets_follow_backward_order_one_dtype_each_up_to_the_cap():
    f32, bf16 = torch.float32, torch.bfloat16
    sizes = [(10, f32), (300, f32), (20, bf16), (30, f32), (40, f32), (5, bf16)]
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in sizes]
    buckets = bucket_params(params, cap_bytes=400)
    # Last defined first; 40 + 30 floats fill 280 of 400 bytes, 300 floats pass the cap alone.
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b] for b in buckets] == [[5, 2], [4, 3], [1], [0]]


def test_bucket_size_and_reduce_dtype_are_checked():
    assert load_config(None, []).parallel.dp_bucket_mb == 25.0
    with pytest.raises(ConfigError, match=r"parallel.dp_bucket_mb=0.0 must be > 0"):
        validate(load_config(None, ["parallel.dp_bucket_mb=0"]), 1)
    with pytest.raises(ConfigError, match="parallel.dp_reduce_dtype"):
        load_config(None, ["parallel.dp_reduce_dtype=fp16"])
