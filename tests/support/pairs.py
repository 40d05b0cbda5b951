"""A test objective that is not token cross-entropy: a sequence-level loss over pairs of rows,
train.objective=tests.support.pairs:PairPreference.

Rows 2k and 2k + 1 of the global batch are a pair; each row's score is the sum of its target
tokens' log-probabilities, s, and a pair's loss is -log sigmoid(beta (s_2k - s_2k+1)) (DPO's
shape without a reference model), averaged over the pairs of the global batch. It is equal to
one process only if the pairs stay together in one micro-batch on one rank, a row's score is
summed over its CP shares, and the denominator (the pairs) is counted over every DP rank.
"""
import torch
import torch.nn.functional as F

from megalite.parallel.mappings import all_reduce_over
from megalite.pipeline.objective import whole_rows

BETA = 0.02  # small: the fp32 drift of 10 steps (gradient norms up to ~3) stays within 1e-5


class PairPreference:
    group_rows = 2

    def denominator(self, batches: list, n_tokens: torch.Tensor, dp_group) -> torch.Tensor:
        rows = sum(b.input_ids.shape[0] for b in batches)
        return all_reduce_over(torch.tensor(rows / 2, device=n_tokens.device), dp_group)

    def forward_kwargs(self, scale: torch.Tensor) -> dict:
        return {}  # the per-token losses, differentiable

    def loss(self, out, batch, scale: torch.Tensor, cp) -> torch.Tensor:
        score = whole_rows(-out.token_losses.sum(dim=1), cp)
        pairs = -F.logsigmoid(BETA * (score[0::2] - score[1::2]))
        return pairs.sum() * scale / cp.size  # every CP rank holds the whole scores


def pair_loss(token_losses: torch.Tensor) -> torch.Tensor:
    """The mean pair loss of whole rows' token losses [rows, tokens], written out again."""
    score = -token_losses.sum(dim=1)
    return (-F.logsigmoid(BETA * (score[0::2] - score[1::2]))).mean()
