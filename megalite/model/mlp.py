"""The Megatron MLP: Y = act(X A) with A split by columns, Z = Y B with B split by rows.

The activation is element-wise, so it runs on each rank's columns with no communication: one
all-reduce forward (g, in B) and one backward (the shared f on the input). SwiGLU (Llama)
computes silu(X A_gate) * (X A_up), both column-parallel with the same split.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.mappings import copy_to_tensor_parallel_region
from megalite.parallel.state import ParallelState


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, pstate: ParallelState):
        super().__init__()
        self.activation = cfg.activation
        self.tp_group = pstate.tp_group
        std = cfg.init_std

        def column() -> ColumnParallelLinear:
            return ColumnParallelLinear(cfg.hidden, cfg.ffn, pstate, bias=cfg.bias,
                                        init_std=std, copy_input=False)

        self.gate = column() if cfg.activation == "swiglu" else None
        self.up = column()
        self.down = RowParallelLinear(cfg.ffn, cfg.hidden, pstate, bias=cfg.bias,
                                      init_std=std / math.sqrt(2 * cfg.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel_region(x, self.tp_group)
        if self.gate is not None:
            y = F.silu(self.gate(x)) * self.up(x)
        else:
            y = F.gelu(self.up(x), approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down(y)
