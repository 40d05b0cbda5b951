"""Position information: a learned table (GPT-2) or rotary embeddings (Llama)."""
from __future__ import annotations

import torch
from torch import nn

from megalite.parallel.init import Init, set_init
from megalite.parallel.mappings import sum_grad_over_shards
from megalite.parallel.state import ParallelState


class LearnedPositions(nn.Module):
    """GPT-2's position table, replicated on every TP rank (it is small). Sequence parallel, a
    rank looks up the positions of its shard only, so the gradient is summed over TP."""

    def __init__(self, max_seq_len: int, hidden: int, pstate: ParallelState, init_std: float):
        super().__init__()
        self.tp_group = pstate.tp_group
        self.weight = set_init(nn.Parameter(torch.empty(max_seq_len, hidden, device=pstate.device)),
                               Init(std=init_std))

    def forward(self, positions: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        weight = sum_grad_over_shards(self.weight, self.tp_group, sequence_parallel)
        return nn.functional.embedding(positions, weight)


class Rotary(nn.Module):
    """Rotary embeddings (Su et al. 2021) in the rotate-half layout that Hugging Face Llama uses."""

    def __init__(self, head_dim: int, theta: float, device: torch.device):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / theta ** exponents, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [batch, 1, seq, head_dim], broadcast over heads."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [batch, heads, seq, head_dim] by the angles of each token's position."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
