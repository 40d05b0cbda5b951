"""The vocabulary split across TP ranks: embedding, and the softmax statistics of a
cross-entropy on split logits (head_loss.py fuses them with the LM head).

Rank r owns vocab rows [r V/t, (r+1) V/t) of the (padded) vocabulary V. The LM head produces
only those columns of the logits, and the loss is computed without ever gathering them: for a
50k-128k vocabulary the full logits are the largest activation of the whole model.
"""
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.compiled import fused
from megalite.parallel.init import new_param
from megalite.parallel.mappings import all_reduce_over
from megalite.parallel.sharding import mark_sharded
from megalite.parallel.contexts import TensorParallel

IGNORE_INDEX = -100


class VocabParallelEmbedding(nn.Module):
    """Look up the ids this rank owns, zero the others, and sum over ranks: g, or with sequence
    parallelism the SP paper's g-bar, which leaves each rank its sequence shard of the sum."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel, *, init_std: float):
        super().__init__()
        local = vocab // tp.size
        self.vocab_start = tp.rank * local
        self.vocab_end = self.vocab_start + local
        self.tp = tp
        self.weight = new_param(local, hidden, std=init_std)
        mark_sharded(self.weight, 0, tp.rank, tp.size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.reduce(rows)


class SoftmaxStats(NamedTuple):
    """What the vocab-parallel softmax of some tokens leaves behind: per token, the global max
    logit and the sum over all ranks of exp(z - max), the loss (0 where ignored), and where
    each label is among this rank's columns."""

    z_max: torch.Tensor
    sum_exp: torch.Tensor
    loss: torch.Tensor
    local: torch.Tensor  # the label's column here (0 where it is not this rank's)
    mine: torch.Tensor  # the label is one of this rank's columns
    ignored: torch.Tensor


def label_columns(labels: torch.Tensor, vocab_start: int, columns: int) -> tuple:
    """(the label's column here, 0 where not this rank's; whether it is; whether ignored)."""
    ignored = labels == IGNORE_INDEX
    local = labels - vocab_start
    mine = (local >= 0) & (local < columns) & ~ignored
    return local.masked_fill(~mine, 0), mine, ignored


def softmax_stats_(z: torch.Tensor, labels: torch.Tensor, vocab_start: int, group) -> SoftmaxStats:
    """loss = log(sum_v exp(z_v)) - z_target over fp32 logits z [tokens, V/t] split by vocab,
    with three all-reduces of [tokens]-sized tensors (max, target logit, sum of exp). z is
    overwritten with exp(z - max): the caller owns it, and no second logits-sized buffer is made."""
    z_max = z.amax(dim=-1)
    all_reduce_over(z_max, group, op=dist.ReduceOp.MAX)
    local, mine, ignored = label_columns(labels, vocab_start, z.shape[-1])
    z_target, sum_exp = fused(shifted_exp_, z.device)(z, z_max, local, mine)
    all_reduce_over(z_target, group)
    all_reduce_over(sum_exp, group)
    loss = (sum_exp.log() - z_target).masked_fill(ignored, 0.0)
    return SoftmaxStats(z_max, sum_exp, loss, local, mine, ignored)


def shifted_exp_(z: torch.Tensor, z_max: torch.Tensor, local: torch.Tensor,
                 mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part, no communication: z becomes exp(z - max) in place; (the label's
    z - max here, 0 where the label is not this rank's; the sum of exp here)."""
    z.sub_(z_max.unsqueeze(-1))
    z_target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    return z_target, z.exp_().sum(dim=-1)


def softmax_grad_(exp: torch.Tensor, stats: SoftmaxStats, grad_loss: torch.Tensor) -> torch.Tensor:
    """In place: exp(z - max) becomes the gradient of sum(grad_loss * loss) with respect to the
    logits, (softmax - one_hot) * grad_loss, local to this rank's columns (no communication)."""
    return fused(softmax_grad_local_, exp.device)(exp, stats.sum_exp, stats.local, stats.mine,
                                                  grad_loss.masked_fill(stats.ignored, 0.0))


def softmax_grad_local_(exp: torch.Tensor, sum_exp: torch.Tensor, local: torch.Tensor,
                        mine: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """softmax_grad_ on plain tensors (what `fused` compiles); grad_loss 0 where ignored."""
    exp.div_(sum_exp.unsqueeze(-1))
    exp.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(exp.dtype))
    return exp.mul_(grad_loss.unsqueeze(-1))
