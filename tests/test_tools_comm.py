"""What bench/comm.py's CommLog counts, against what the model and trainer must send.

- collectives per transformer layer: 2 all-reduces forward and 2 backward (TP > 1); with
  sequence parallelism, all-gather / reduce-scatter pairs, plus one small all-reduce per
  replicated parameter in backward;
- bucketed DP gradient sync: one DP all-reduce per bucket, with the synced gradients exactly the
  per-rank gradients summed (the single process's to fp32 rounding; bf16 within its rounding),
  and the norm the full one;
- the MoE all-to-alls' bytes per layer equal the formula the scaling model uses
  (bench/scaling_model.py), at EP2 and EP4.
"""
import collections
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from bench.comm import CommLog
from bench.scaling_model import moe_all_to_all_bytes
from megalite.config import ParallelConfig
from megalite.model import GPT
from megalite.parallel.sharding import shard_of
from megalite.parallel.state import ParallelState
from megalite.training.grads import DataParallelGradSync, MIB, clip_grad_norm_
from megalite.typed_config import replaced
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, gather_full, padded_batch
from tests.support.moe import MOE, moe_layers

pytestmark = pytest.mark.exactness


VARIANTS = {**CONFIGS, "gpt2-gqa1": replaced(CONFIGS["gpt2"], "attention.n_kv_heads", 1)}


def count_collectives(config_name: str, tp: int, sequence_parallel: bool = False) -> dict:
    cfg = VARIANTS[config_name]
    ps = ParallelState.from_world(tp)
    model = GPT(cfg, ps, seed=0, parallel=ParallelConfig(tp=tp, sequence_parallel=sequence_parallel))
    ids, mask, labels = padded_batch(cfg, "right")
    with CommLog(ps) as forward:
        loss = model(ids, labels=labels).token_losses.sum()
    with CommLog(ps) as backward:
        loss.backward()
    return dict(collections.Counter((phase, r["op"], r["ranks"]) for phase, log in
                                    (("forward", forward), ("backward", backward))
                                    for r in log.records))


@pytest.mark.parametrize("config_name,tp,world,per_layer_backward_extra", [
    ("gpt2", 2, 2, 0),
    ("llama", 2, 2, 0),
    # n_kv_heads=2 < tp=4: the two copies of each KV weight sum their gradients, one more
    # all-reduce per layer in backward, over the pair of ranks that share it.
    ("llama", 4, 4, 1),
    # With biases, the KV bias's copies sum theirs too: one more again.
    ("gpt2-gqa1", 2, 2, 2),
])
def test_two_all_reduces_per_layer_each_way(config_name, tp, world, per_layer_backward_extra):
    layers = VARIANTS[config_name].n_layers
    calls = run_distributed(count_collectives, world, config_name, tp)[0]
    expected = {
        # 2 per layer (attention and MLP g) + embedding g + loss (max, target logit, sum-exp)
        ("forward", "all_reduce", tp): 2 * layers + 1 + 3,
        # 2 per layer (attention and MLP f) + the LM head's f
        ("backward", "all_reduce", tp): 2 * layers + 1,
    }
    if per_layer_backward_extra:
        copies = tp // min(tp, VARIANTS[config_name].kv_heads)
        key = ("backward", "all_reduce", copies)
        expected[key] = expected.get(key, 0) + per_layer_backward_extra * layers
    assert calls == expected


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_all_reduces_become_reduce_scatter_and_all_gather_pairs(config_name):
    cfg = CONFIGS[config_name]
    layers, tp = cfg.n_layers, 2
    calls = run_distributed(count_collectives, tp, config_name, tp, True)[0]
    # Replicated parameters used on the shard: norm weights (and biases), row-parallel biases,
    # the position table; each sums its gradient over TP with one all-reduce in backward.
    per_layer = 2 * (2 if cfg.bias else 1) + (2 if cfg.bias else 0)
    once = (2 if cfg.bias else 1) + (1 if cfg.positions.kind == "learned" else 0)
    assert calls == {
        # attention and MLP: g gathers their input, g-bar reduce-scatters their output; the
        # head's g; the embedding's g-bar; the loss's three all-reduces are unchanged.
        ("forward", "all_gather", tp): 2 * layers + 1,
        ("forward", "reduce_scatter", tp): 2 * layers + 1,
        ("forward", "all_reduce", tp): 3,
        # g: each block's stored shard gathered again, then its gradient reduce-scattered (the
        # fused head + loss keeps no shard to gather again: it keeps its gathered input, or in
        # training nothing); g-bar's backward all-gathers.
        ("backward", "all_gather", tp): 2 * 2 * layers + 1,
        ("backward", "reduce_scatter", tp): 2 * layers + 1,
        ("backward", "all_reduce", tp): per_layer * layers + once,
    }


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


def count_all_to_all_bytes(ep: int) -> tuple[int, int]:
    """(bytes this rank's all-to-alls took over the EP group in one forward and backward,
    the formula's for its MoE layers)."""
    cfg = MOE["top2"]
    ps = ParallelState.from_world(1, pipeline=ParallelConfig(ep=ep))
    model = GPT(cfg, ps, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(ps.dp_rank))
    with CommLog(ps) as log:
        model(ids, labels=ids, loss_scale=0.01).loss.backward()
    measured = sum(r["bytes"] for r in log.records if r["op"] == "all_to_all_single" and r["group"] == "ep")
    return measured, len(moe_layers(model)) * moe_all_to_all_bytes(cfg, ids.numel(), 4)


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_all_bytes_per_layer_equal_the_formula(ep):
    """Summed over the EP ranks: a rank's outputs going back are its experts' rows, which only
    balanced routing makes equal to its own tokens' copies."""
    measured, formula = (sum(column) for column in zip(*run_distributed(count_all_to_all_bytes, ep, ep)))
    assert measured == formula > 0
