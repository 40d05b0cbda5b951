"""What a step minimises (train.objective): the objective as a seam.

An objective is handed each micro-batch's output on the last pipeline stage and gives this
rank's share of that micro-batch's loss sum, times `scale`: 1 / the objective's denominator over
the whole global batch (every micro-batch of every DP rank, known before the first forward).
The shares of all micro-batches, DP ranks and CP ranks add up to the one-process loss, so every
layout and accumulation count trains the same model (pipeline/runner.train_pipelined calls it).

    group_rows       rows that belong together (a chosen/rejected pair, a group of sampled
                     answers) are this many consecutive rows of the global batch: the order
                     shuffles them as one (data/batches.BatchOrder), the plan keeps micro-batches
                     a multiple of it, and each DP rank reads contiguous rows
    denominator      the global batch's count the loss is the mean over (a tensor, summed over DP)
    forward_kwargs   what the model's forward is asked for: the fused head's scaled loss sum
                     (`loss_scale`: the head makes its gradients in forward), or nothing, and
                     then the per-token losses are differentiable (minus each target's log-prob)
    loss             this rank's share of the micro-batch's loss sum x scale (differentiable)

train.objective names one of OBJECTIVES, or any class by import path (`package.module:Name`),
made with no arguments. A sequence-level objective sums a row's token log-probabilities over
its CP shares with `whole_rows` (tests/support/pairs.py is one).
"""
from importlib import import_module

import torch

from megalite.parallel.contexts import ContextParallel
from megalite.parallel.mappings import sum_shares


def whole_rows(shares: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Per-row sums [batch] of this CP rank's share of each row's tokens, made whole (every
    CP rank then holds them: its loss share is 1 / cp.size of what they give)."""
    return sum_shares(shares, cp.group)


class LanguageModel:
    """Next-token cross-entropy: the mean over every target token of the global batch (SFT's
    prompt tokens are no targets: their labels are -100)."""

    group_rows = 1

    def denominator(self, batches: list, n_tokens: torch.Tensor, dp_group) -> torch.Tensor:
        return n_tokens  # the global target count, which the token counter sums already

    def forward_kwargs(self, scale: torch.Tensor) -> dict:
        return {"loss_scale": scale}

    def loss(self, out, batch, scale: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        return out.loss  # this rank's tokens' sum x scale, from the fused head + loss


OBJECTIVES = {"lm": LanguageModel}  # train.objective -> the objective


def objective_of(name: str):
    """The objective train.objective names (a ValueError naming it if there is none)."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]()
    module, _, attr = name.partition(":")
    try:
        return getattr(import_module(module), attr)()
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        raise ValueError(f"train.objective={name!r} is neither one of {sorted(OBJECTIVES)} nor a "
                         f"class by import path (package.module:Name) made with no arguments: "
                         f"{type(e).__name__}: {e}") from None
