"""Where a tensor the optimizer steps sits in the logical matrices Muon orthogonalises.

A stepped tensor is rows [start, stop) of a rank's local tensor (all of them, but for ZeRO-1's
share), and the local tensor is a TP slice of the whole weight along dim 0 (column-parallel)
or 1 (row-parallel), or all of it. `whole` gathers the whole weight: the rows over the replica
group, then the slices over the TP group (all-gathers, padded to the largest share). The whole
weight holds one logical matrix, or several:

    interleaved (parts, size)   (sharding.mark_interleaved) dim 0 in blocks of parts x size rows, part j of every block
                                one matrix: the fused K/V weight [k_0, v_0, k_1, v_1, ...] is
                                K and V, as Hugging Face's k_proj and v_proj are
    stacked                     dim 0 indexes matrices: MoE experts, orthogonalised each alone;
                                their rows are whole experts, so nothing is gathered

`matrices` splits the whole weight into them, `join` puts their updates back, and `mine` cuts
this rank's rows of its slice out again.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.parallel.sharding import Shard, expert_shard_of, interleaved_of, row_range, shard_of


@dataclass(frozen=True)
class MatrixLayout:
    rows: tuple[int, int] | None = None  # held rows of `local_rows`, gathered over `replicas`
    local_rows: int = 0
    replicas: tuple = (None, 0, 1)  # (group, this rank's index, size)
    tp: Shard | None = None  # the TP slice, gathered over `tp_group` (count > 1 only)
    tp_group: object = None
    tp_size: int = 1
    interleaved: tuple[int, int] | None = None
    stacked: bool = False

    # Stacked experts' layouts hold no rows and no TP slice: `whole` and `mine` leave them as they are.
    def whole(self, t: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            group, _, size = self.replicas
            t = _gather(t, group, size, [row_range(self.local_rows, k, size) for k in range(size)])
        if self.tp is not None:
            dim, span = self.tp.dim, t.shape[self.tp.dim]
            t = _gather(t.movedim(dim, 0).contiguous(), self.tp_group, self.tp_size,
                        [(k * span, (k + 1) * span) for k in range(self.tp_size)])
            # Ranks holding the same slice (GQA's KV heads over more TP ranks) sent it each.
            copies = self.tp_size // self.tp.count
            t = t.view(self.tp_size, span, *t.shape[1:])[::copies].flatten(0, 1).movedim(0, dim)
        return t

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            full = self.tp.take(full)
        if self.rows is not None:
            full = full[self.rows[0]:self.rows[1]]
        return full

    def matrices(self, full: torch.Tensor) -> list[torch.Tensor]:
        if self.stacked:
            return list(full.unbind(0))
        if self.interleaved is not None:
            parts, size = self.interleaved
            blocks = full.view(-1, parts, size, full.shape[-1])
            return [blocks[:, j].reshape(-1, full.shape[-1]) for j in range(parts)]
        return [full]

    def join(self, matrices: list[torch.Tensor]) -> torch.Tensor:
        if self.stacked:
            return torch.stack(matrices)
        if self.interleaved is not None:
            parts, size = self.interleaved
            cols = matrices[0].shape[-1]
            return torch.stack([m.view(-1, size, cols) for m in matrices], dim=1).view(-1, cols)
        return matrices[0]


def _gather(t: torch.Tensor, group, size: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The members' blocks of dim 0, block k being rows spans[k] of the result: one
    all-gather of blocks padded to the longest (size > 1: a layout gathers only over several)."""
    longest = max(stop - start for start, stop in spans)
    padded = t.new_zeros(longest, *t.shape[1:])
    padded[:t.shape[0]] = t
    out = t.new_empty(size * longest, *t.shape[1:])
    dist.all_gather_into_tensor(out, padded, group=group)
    return torch.cat([out[k * longest:k * longest + stop - start]
                      for k, (start, stop) in enumerate(spans)])


def stacks_matrices(p: torch.Tensor) -> bool:
    """Whether dim 0 of p indexes its matrices (MoE experts)."""
    return expert_shard_of(p) is not None or p.dim() == 3


def layout_of(p: torch.Tensor, pstate, rows: tuple[int, int] | None = None,
              replicas: tuple = (None, 0, 1)) -> MatrixLayout:
    """The layout of the tensor stepped for model parameter p: its local tensor, or (ZeRO-1)
    rows `rows` of it, held by member replicas[1] of the replica group (group, index, size)."""
    if stacks_matrices(p):
        return MatrixLayout(stacked=True)
    shard = shard_of(p)
    split = shard is not None and shard.count > 1
    return MatrixLayout(rows=rows if replicas[2] > 1 else None, local_rows=p.shape[0],
                        replicas=replicas, tp=shard if split else None,
                        tp_group=pstate.tp_group if split else None, tp_size=pstate.tp_size,
                        interleaved=interleaved_of(p))
