"""The vocabulary split across TP ranks: embedding, and a cross-entropy on split logits.

Rank r owns vocab rows [r V/t, (r+1) V/t) of the (padded) vocabulary V. The LM head produces
only those columns of the logits, and the loss is computed without ever gathering them: for a
50k-128k vocabulary the full logits are the largest activation of the whole model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.parallel.init import Init, set_init
from megalite.parallel.mappings import group_size, reduce_partial_sums
from megalite.parallel.sharding import mark_sharded
from megalite.parallel.state import ParallelState

IGNORE_INDEX = -100


class VocabParallelEmbedding(nn.Module):
    """Look up the ids this rank owns, zero the others, and sum over ranks: g, or with sequence
    parallelism the SP paper's g-bar, which leaves each rank its sequence shard of the sum."""

    def __init__(self, vocab: int, hidden: int, pstate: ParallelState, *, init_std: float):
        super().__init__()
        local = vocab // pstate.tp_size
        self.vocab_start = pstate.tp_rank * local
        self.vocab_end = self.vocab_start + local
        self.tp_group = pstate.tp_group
        self.weight = set_init(nn.Parameter(torch.empty(local, hidden, device=pstate.device)),
                               Init(std=init_std))
        mark_sharded(self.weight, 0, pstate.tp_rank, pstate.tp_size)

    def forward(self, ids: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_partial_sums(rows, self.tp_group, sequence_parallel)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = log(sum_v exp(z_v)) - z_target, over logits z split by vocab.

    Forward: three all-reduces of [tokens]-sized tensors (max, target logit, sum of exp).
    Backward: softmax - one_hot, entirely local.
    """

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        logits = logits.float()
        z_max = logits.max(dim=-1).values
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        z = logits - z_max.unsqueeze(-1)

        ignored = labels == IGNORE_INDEX
        local = labels - vocab_start
        mine = (local >= 0) & (local < z.shape[-1]) & ~ignored
        local = local.masked_fill(~mine, 0)
        z_target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        dist.all_reduce(z_target, group=group)

        exp = z.exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - z_target).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine, ignored = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                 tp_group) -> torch.Tensor:
    """Per-token losses (0 where labels == -100) from this rank's vocab slice of the logits."""
    if group_size(tp_group) == 1:
        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="none").view_as(labels)
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, tp_group)
