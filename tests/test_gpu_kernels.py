"""On a GPU: the kernels the model calls, each against a reference.

- the fused LM head + loss (parallel/head_loss.py) in bf16 = a float64 reference, on a GPT-2
  sized vocabulary, autocast (fp32 weights) and pure bf16 tensors, both its paths;
- greedy generation with the KV cache on the GPU = without the cache = on the CPU;
- MoE experts' grouped matmul in bf16 (model/moe.py) = the loop over experts, forward and
  backward, with an expert that gets no row.

Skipped where there is no CUDA device; `python -m bench gpu-check` runs it with the rest of the
GPU tests (tests/test_gpu.py holds the whole model's checks; tests/support/gpu.py the shared helpers).
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megalite.generate import generate
from megalite.model import GPT
from megalite.parallel.head_loss import HeadShard, head_loss_sum, head_token_losses
from megalite.parallel.state import ParallelState
from tests.support.generation import PROMPTS
from tests.support.gpu import CUDA, assert_relative_norm
from tests.support.models import CONFIGS, PAD_ID

# no_tf32 (tests/conftest.py): fp32 matmuls in full fp32 in every test here.
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("no_tf32"),
              pytest.mark.exactness]


# ---------------------------------------------------------------------------------------------
# The fused LM head + loss in bf16 = float64.

# The matmuls round their inputs to bf16 (2^-9 relative) and their outputs too (each chunk's
# logits, dX, each chunk's dE); the softmax statistics are fp32. Logits here reach ~18, where
# a bf16 ulp is 2^-4: a token's loss moves by a few hundredths (0.04 measured with CPU bf16
# matmuls, which also accumulate in fp32), 0.15 allowed; the mean loss (~15), whose roundings
# average out, by ~2e-4, 5e-3 allowed; the weighted sum by ~1e-4 relative, 1e-3 allowed; dX
# and dE by ~0.45% of their norm, 2^-6 (1.6%) allowed. A softmax summed in bf16 over 50k
# columns, a chunk lost or counted twice, or the padded columns let in, err by far more.
HEAD_TOKEN_TOL, HEAD_MEAN_TOL, HEAD_SUM_TOL, HEAD_GRAD_TOL = 0.15, 5e-3, 1e-3, 2**-6


def head_inputs(device: torch.device, tokens: int, hidden: int, vocab: int, padded_vocab: int):
    """Hidden states (as the final norm leaves them: unit scale), a head spread like a trained
    one's (logits of std ~3), labels with 10% ignored, and per-token weights."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(padded_vocab, hidden, generator=g) * (3 / hidden**0.5)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[torch.rand(tokens, generator=g) < 0.1] = -100
    weights = torch.rand(tokens, generator=g) / tokens
    return [t.to(device) for t in (x, w, labels, weights)]


def float64_head_loss(x, w, labels, weights, vocab: int):
    """The unfused head + loss in float64: (per-token losses, weighted sum, dX, dE)."""
    x = x.double().requires_grad_()
    w = w.double().requires_grad_()
    z = x @ w.t()
    z = z.masked_fill(torch.arange(z.shape[-1], device=z.device) >= vocab, float("-inf"))
    losses = F.cross_entropy(z, labels, reduction="none", ignore_index=-100)
    total = (losses * weights.double()).sum()
    total.backward()
    return losses.detach(), total.detach(), x.grad, w.grad


def check_head_loss_in_bf16(device: torch.device, tokens: int = 1000, hidden: int = 128,
                            vocab: int = 50257, chunk: int = 300) -> None:
    """Both paths of the fused head (the training one, gradients made in forward; per-token
    losses, logits recomputed in backward), bf16 as autocast runs it (fp32 x and weight, bf16
    matmuls) and as pure_bf16 does (bf16 x and weight), in uneven chunks, with vocab padding."""
    padded_vocab = -(-vocab // 128) * 128
    x, w, labels, weights = head_inputs(device, tokens, hidden, vocab, padded_vocab)
    ref_losses, ref_total, ref_dx, ref_dw = float64_head_loss(x, w, labels, weights, vocab)
    shard = HeadShard(0, vocab, None, chunk)
    for mode in ("autocast", "pure_bf16"):
        dtype = torch.float32 if mode == "autocast" else torch.bfloat16
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if mode == "autocast"
                    else nullcontext())
        for path in ("loss sum", "token losses"):
            xi = x.to(dtype, copy=True).requires_grad_()
            wi = w.to(dtype, copy=True).requires_grad_()
            with autocast:
                if path == "loss sum":
                    total, losses = head_loss_sum(xi, wi, labels, weights, shard)
                else:
                    losses = head_token_losses(xi, wi, labels, shard)
                    total = (losses * weights).sum()
            total.backward()
            what = f"{mode}, {path}"
            assert xi.grad.dtype == dtype and wi.grad.dtype == dtype, what
            assert losses.dtype == torch.float32, what
            assert_close(losses.detach().double().cpu(), ref_losses.cpu(), atol=HEAD_TOKEN_TOL,
                         rtol=0, msg=lambda m: f"{what}, token losses: {m}")
            count = (labels != -100).sum()
            mean, ref_mean = losses.detach().double().sum() / count, ref_losses.sum() / count
            assert abs(float(mean - ref_mean)) <= HEAD_MEAN_TOL, (what, float(mean),
                                                                  float(ref_mean))
            assert_relative_norm(total.detach(), ref_total, HEAD_SUM_TOL, f"{what}, weighted sum")
            assert_relative_norm(xi.grad, ref_dx, HEAD_GRAD_TOL, f"{what}, d hidden")
            assert_relative_norm(wi.grad, ref_dw, HEAD_GRAD_TOL, f"{what}, d weight")
            assert not wi.grad[vocab:].any(), what  # padded rows: no gradient


def test_fused_head_loss_in_bf16_equals_float64():
    check_head_loss_in_bf16(CUDA)


# ---------------------------------------------------------------------------------------------
# Generation with the KV cache.

# Greedy tokens must agree exactly, unless the reference's best two logits were within
# TIE_TOL of each other where they part: fp32 (TF32 off) logits of the cached and uncached
# paths, and of GPU and CPU, differ by ~1e-6; a near-tie that close is a coin toss, not a bug.
TIE_TOL = 1e-4
NEW_TOKENS = 10


def check_same_greedy(model: GPT, got: list[list[int]], expected: list[list[int]],
                      what: str) -> None:
    for row, (a, b) in enumerate(zip(got, expected)):
        if a == b:
            continue
        assert len(a) == len(b) == NEW_TOKENS, f"{what}, row {row}: {a} vs {b}"  # no eos given
        i = next(i for i, (s, t) in enumerate(zip(a, b)) if s != t)
        prefix = PROMPTS[row] + b[:i]
        with torch.no_grad():
            out = model(torch.tensor([prefix], device=model.pstate.device))
            logits = model.full_logits(out.logits[0, -1])
        top2 = logits.float().topk(2).values
        assert float(top2[0] - top2[1]) < TIE_TOL, f"{what}, row {row}: {a} vs {b} (at {i})"


def check_generation(device: torch.device) -> None:
    """Left-padded prompts, greedy: the cached decode on `device` = the uncached one (a full
    forward per token) = the CPU's, for both configs."""
    for name in sorted(CONFIGS):
        # A wider init than 0.02: at small init the tied head mostly repeats the last token,
        # and the greedy tokens would hardly depend on the cached context.
        cfg = dataclasses.replace(CONFIGS[name], init_std=0.2)
        model = GPT(cfg, ParallelState(device=device), seed=3)
        cpu_model = GPT(cfg, ParallelState(), seed=3)
        cache = model.new_cache(len(PROMPTS), 8)
        assert cache.keys[0].device.type == device.type and cache.keys[0].dtype == torch.float32
        cached = generate(model, PROMPTS, NEW_TOKENS, pad_id=PAD_ID)
        uncached = generate(model, PROMPTS, NEW_TOKENS, pad_id=PAD_ID, use_cache=False)
        on_cpu = generate(cpu_model, PROMPTS, NEW_TOKENS, pad_id=PAD_ID)
        assert [len(r) for r in cached] == [NEW_TOKENS] * len(PROMPTS), name
        check_same_greedy(model, cached, uncached, f"{name}: cached vs uncached")
        check_same_greedy(cpu_model, cached, on_cpu, f"{name}: {device.type} vs cpu")
        # Each row as if alone: the left padding changes nothing.
        alone = [generate(model, [p], NEW_TOKENS, pad_id=PAD_ID)[0] for p in PROMPTS]
        check_same_greedy(model, cached, alone, f"{name}: batched vs alone")


def test_kv_cache_generation_equals_full_forward_and_cpu():
    check_generation(CUDA)


def test_moe_grouped_matmul_equals_the_loop():
    from megalite.parallel.matmul import HIGH, NO_SPLITS
    device = CUDA
    counts = [5, 0, 11, 16]  # an expert with no row
    x = torch.randn(sum(counts), 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 48, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    grouped = HIGH.grouped(x, w, counts, NO_SPLITS)
    g = torch.randn_like(grouped)
    grouped.backward(g)
    dx, dw = x.grad, w.grad
    x.grad = w.grad = None
    loop = torch.cat([F.linear(part, w[e]) for e, part in enumerate(x.split(counts))])
    loop.backward(g)
    assert_close(grouped, loop, atol=2e-2, rtol=2e-2)
    assert_close(dx, x.grad, atol=2e-2, rtol=2e-2)
    assert_close(dw, w.grad, atol=2e-2, rtol=2e-2)
