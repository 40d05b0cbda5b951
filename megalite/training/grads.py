"""Gradients across ranks: DP all-reduce overlapped with backward, and the global norm.

DP: every DP rank holds the same parameters and the loss is normalised by the GLOBAL token
count, so the right gradient is the SUM over DP ranks. Each parameter's all-reduce starts as
soon as backward has accumulated its gradient on the last micro-batch, while backward carries
on with earlier layers.

Norm: TP slices of one weight are disjoint parts of it, so their squared norms add up over
the TP group; replicated parameters are identical on every TP rank and count once; a slice
held by c copies (GQA's KV heads) counts 1/c per copy.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from megalite.parallel.mappings import group_size
from megalite.parallel.sharding import shard_of
from megalite.parallel.state import ParallelState


class DataParallelGradSync:
    def __init__(self, model: torch.nn.Module, pstate: ParallelState):
        self.group = pstate.dp_group
        self.active = False
        self.pending: list = []
        if group_size(self.group) > 1:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, p: torch.Tensor) -> None:
        if self.active:
            self.pending.append(dist.all_reduce(p.grad, group=self.group, async_op=True))

    @contextmanager
    def last_micro_batch(self):
        """Gradients accumulate locally until the backward inside this context reduces them."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def wait(self) -> None:
        for handle in self.pending:
            handle.wait()
        self.pending.clear()


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, pstate: ParallelState) -> torch.Tensor:
    """Scale gradients so their global norm is at most max_norm (0: no clipping); return the norm."""
    device = pstate.device
    split = torch.zeros((), device=device, dtype=torch.float32)
    replicated = torch.zeros((), device=device, dtype=torch.float32)
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        square = p.grad.float().pow(2).sum()
        shard = shard_of(p)
        if shard is None:
            replicated += square
        else:
            split += square * shard.count / pstate.tp_size
    if group_size(pstate.tp_group) > 1:
        dist.all_reduce(split, group=pstate.tp_group)
    norm = (split + replicated).sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale)
    return norm
