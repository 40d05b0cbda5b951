"""The next-token loss of micro-batches on any layout: training's validation and `megalite eval`
both sum it here, so either runs at every TP x CP x PP x DP layout that training runs; and
training's validation itself, what it reads and the loss it logs."""
import math

import numpy as np
import torch

from megalite.data.batches import Mixture
from megalite.parallel.vocab import IGNORE_INDEX
from megalite.run_config import Config

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


def eval_plan(cfg: Config, val_set: Mixture) -> str:
    """What each evaluation will read, said before the first."""
    t, held = cfg.train, sum(val_set.sizes)
    if held == 0:
        return "eval: none (no held-out data)"
    n = sum(val_set.leading_counts(-(-t.eval_tokens // cfg.data.seq_len) if t.eval_tokens else None))
    when = f"every {t.eval_every} steps and at the end" if t.eval_every else "at the end"
    return (f"eval: {n:,} of {held:,} held-out samples (rows of data.seq_len={cfg.data.seq_len}: "
            f"up to {n * cfg.data.seq_len:,} tokens) {when}; train.eval_tokens="
            f"{t.eval_tokens} (0: all)")


@torch.no_grad()
def evaluate(cfg: Config, model, val_set: Mixture, ps: ParallelState, step: int, metrics, autocast) -> None:
    """Mean loss over the held-out set (train.eval_tokens=0), or over its first
    ceil(eval_tokens / seq_len) samples, each source's in proportion to its weight; each sample
    once, DP ranks taking disjoint parts, in micro-batches as in training."""
    t = cfg.train
    if sum(val_set.sizes) == 0:
        return
    picks = val_set.leading_picks(-(-t.eval_tokens // cfg.data.seq_len) if t.eval_tokens else None)
    mine = np.array_split(picks, ps.dp_size)[ps.dp_rank]
    # Experts split over DP ranks pair every rank's forwards (all-to-alls): a rank one sample
    # short runs one more, without targets.
    filler = -(-len(picks) // ps.dp_size) - len(mine) if ps.ep_size > 1 else 0
    mine = np.concatenate([mine, picks[:filler]])
    total = torch.zeros(2, dtype=torch.float64, device=ps.device)
    # A step's worth of micro-batches on the device at a time: memory stays a step's.
    chunk = t.global_batch_size // ps.dp_size
    for first in range(0, len(mine), chunk):
        part = mine[first:first + chunk]
        batches = [val_set.collate(part[start:start + t.micro_batch_size]).to(ps.device)
                   for start in range(0, len(part), t.micro_batch_size)]
        if filler and first + chunk >= len(mine):
            batches[-1].labels[-filler:] = IGNORE_INDEX
        total += loss_sum(model, batches, autocast)
    total = all_reduce_loss(total, ps)
    val_loss, val_tokens = (total[0] / total[1]).item(), int(total[1].item())
    val_ppl = math.exp(min(val_loss, 50.0))  # capped: an untrained model's ppl would overflow
    if metrics:
        metrics.write({"step": step, "val_loss": val_loss, "val_ppl": val_ppl, "val_tokens": val_tokens})
        whole = "the whole held-out set" if t.eval_tokens == 0 else f"train.eval_tokens={t.eval_tokens}"
        print(f"step {step}: val_loss {val_loss:.4f}, val_ppl {val_ppl:.1f} "
              f"({val_tokens:,} tokens: {whole})", flush=True)
