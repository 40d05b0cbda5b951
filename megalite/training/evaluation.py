"""The next-token loss of micro-batches on any layout: training's validation and `megalite eval`
both sum it here, so either runs at every TP x CP x PP x DP layout that training runs."""
from __future__ import annotations

import torch

from megalite.parallel.mappings import all_reduce_over
from megalite.parallel.state import ParallelState
from megalite.pipeline.runner import forward_pipelined


@torch.no_grad()
def loss_sum(model, batches: list, autocast) -> torch.Tensor:
    """[sum of next-token losses, predicted tokens] of this rank's share of the micro-batches
    (float64): all_reduce_loss of it is the whole set's on every rank."""
    ps = model.pstate
    total = torch.zeros(2, dtype=torch.float64, device=ps.device)

    def add(micro: int, out) -> None:
        total[0] += out.token_losses.sum().double()  # this CP rank's tokens of the rows
        if ps.cp_rank == 0:  # every CP rank holds the whole rows' labels: counted once
            total[1] += batches[micro].target_count()

    model.eval()
    forward_pipelined(model, batches, autocast, add)  # at pp=1: each micro-batch in turn
    return total


def all_reduce_loss(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """The sum over DP ranks, CP ranks (each holds its share of every row's tokens) and
    pipeline stages: a loss, which only the last stage computes, on every rank (so every rank
    and metrics.jsonl see the real value)."""
    return all_reduce_over(x, ps.dp_group, ps.cp_group, ps.pp_group)
