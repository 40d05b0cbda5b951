"""Parallel layers against the same layer run in one process: outputs and every gradient."""

import pytest

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.sharding import local_slice, shard_of
from megalite.parallel.state import ParallelState
from megalite.parallel.vocab import VocabParallelEmbedding, softmax_grad_, softmax_stats_
from tests.support.harness import run_distributed
from tests.support.layers import SINGLE, build, randn
from tests.support.models import gather_full

pytestmark = pytest.mark.exactness


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses from logits split by vocab: the softmax statistics forward, softmax -
    one_hot backward, entirely local."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        z = logits.to(torch.float32, copy=True)
        stats = softmax_stats_(z, labels, vocab_start, group)
        ctx.stats = stats
        ctx.save_for_backward(z)
        return stats.loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, = ctx.saved_tensors
        return softmax_grad_(exp, ctx.stats, grad_loss), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                 tp_group) -> torch.Tensor:
    """Per-token losses (0 where labels == -100) from this rank's vocab slice of given logits:
    vocab.py's statistics on logits that are whole here (the model never holds its logits)."""
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, tp_group)


def run(layer: nn.Module, x: torch.Tensor, out_grad) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of `layer` under loss sum(out * out_grad(out))."""
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * out_grad(y)).sum().backward()
    return y.detach(), x.grad


def assert_params_are_slices(layer: nn.Module, ref: nn.Module, ps: ParallelState) -> None:
    """Weights and gradients of `layer` are the slices of `ref`'s, and gather back to them."""
    refs = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        shard = shard_of(p)
        full, full_grad = refs[name].detach(), refs[name].grad
        assert torch.equal(p.detach(), local_slice(full, p)), name
        assert_close(p.grad, local_slice(full_grad, p), msg=name)
        assert torch.equal(gather_full(p.detach(), shard, ps), full), name
        assert_close(gather_full(p.grad, shard, ps), full_grad, msg=name)


def check_linear_layers(*tps: int):
    for tp in tps:
        ps = ParallelState.from_world(tp)
        r, t = ps.tp_rank, ps.tp_size
        x = randn(3, 5, 16, seed=1)
        weights = randn(3, 5, 24, seed=2)

        for gather in (False, True):
            layer = build(ColumnParallelLinear, ps, 16, 24, bias=True, init_std=0.5, gather_output=gather)
            ref = build(ColumnParallelLinear, SINGLE, 16, 24, bias=True, init_std=0.5)
            y, gx = run(layer, x, lambda y: weights if gather else weights.chunk(t, -1)[r])
            y_ref, gx_ref = run(ref, x, lambda y: weights)
            assert_close(y, y_ref if gather else y_ref.chunk(t, -1)[r])
            assert_close(gx, gx_ref)
            assert_params_are_slices(layer, ref, ps)

        # Fewer slices than ranks (GQA's KV heads): each copy's gradient is the sum over its copies.
        if t > 2:
            per_rank = [randn(3, 5, 12, seed=10 + i) for i in range(t)]
            layer = build(ColumnParallelLinear, ps, 16, 24, bias=True, init_std=0.5, shards=2)
            ref = build(ColumnParallelLinear, SINGLE, 16, 24, bias=True, init_std=0.5)
            y, gx = run(layer, x, lambda y: per_rank[r])
            ref_x = x.clone().requires_grad_()
            ref_y = ref(ref_x).chunk(2, -1)
            sum((ref_y[i // (t // 2)] * per_rank[i]).sum() for i in range(t)).backward()
            assert_close(y, ref_y[r // (t // 2)].detach())
            assert_close(gx, ref_x.grad)
            assert_params_are_slices(layer, ref, ps)

        for parallel_input in (True, False):
            layer = build(RowParallelLinear, ps, 24, 16, bias=True, init_std=0.5,
                          input_is_parallel=parallel_input)
            ref = build(RowParallelLinear, SINGLE, 24, 16, bias=True, init_std=0.5)
            full_in = randn(3, 5, 24, seed=3)
            y, gx = run(layer, full_in.chunk(t, -1)[r] if parallel_input else full_in, lambda y: x)
            y_ref, gx_ref = run(ref, full_in, lambda y: x)
            assert_close(y, y_ref)
            assert_close(gx, gx_ref.chunk(t, -1)[r] if parallel_input else gx_ref)
            assert_params_are_slices(layer, ref, ps)


def check_vocab_layers(*tps: int):
    vocab, real_vocab = 32, 27
    for tp in tps:
        ps = ParallelState.from_world(tp)
        r, t = ps.tp_rank, ps.tp_size
        ids = torch.randint(0, real_vocab, (3, 7), generator=torch.Generator().manual_seed(4))
        layer = build(VocabParallelEmbedding, ps, vocab, 8, init_std=1.0)
        ref = build(VocabParallelEmbedding, SINGLE, vocab, 8, init_std=1.0)
        grad = randn(3, 7, 8, seed=5)
        for module in (layer, ref):
            (module(ids) * grad).sum().backward()
        assert_close(layer(ids), ref(ids))
        assert_params_are_slices(layer, ref, ps)

        # Cross-entropy on split logits, with padded columns at -inf and ignored labels.
        logits = randn(3, 7, vocab, seed=6)
        logits[..., real_vocab:] = float("-inf")
        labels = ids.clone()
        labels[0, :3] = -100
        labels[2, 6] = -100
        weights = randn(3, 7, seed=8)
        local = logits.chunk(t, -1)[r].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, labels, r * vocab // t, ps.tp_group)
        (loss * weights).sum().backward()
        full = logits.clone().requires_grad_()
        ref_loss = F.cross_entropy(full.flatten(0, 1), labels.flatten(), reduction="none").view(3, 7)
        (ref_loss * weights).sum().backward()
        assert_close(loss, ref_loss)
        assert bool((loss[labels == -100] == 0).all())
        assert_close(local.grad, full.grad.chunk(t, -1)[r])
        assert bool((full.grad[..., real_vocab:] == 0).all())


def test_column_and_row_parallel_linear_match_one_process():
    run_distributed(check_linear_layers, 4, 2, 4)


def test_vocab_parallel_embedding_and_cross_entropy_match_one_process():
    run_distributed(check_vocab_layers, 4, 2, 4)
