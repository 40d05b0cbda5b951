"""The Megatron MLP: Y = act(X A) with A split by columns, Z = Y B with B split by rows.

The activation is element-wise, so it runs on each rank's columns with no communication: one
all-reduce forward (g, in B) and one backward (the shared f on the input); sequence parallel,
the SP paper's g and g-bar in their place. SwiGLU (Llama) computes silu(X A_gate) * (X A_up),
both column-parallel with the same split.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from megalite.parallel.state import ParallelState


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, pstate: ParallelState):
        super().__init__()
        self.activation = cfg.activation
        self.tp_group = pstate.tp_group
        std = cfg.init_std

        def column() -> ColumnParallelLinear:
            return ColumnParallelLinear(cfg.hidden, cfg.ffn, pstate, bias=cfg.bias, init_std=std)

        self.gate = column() if cfg.activation == "swiglu" else None
        self.up = column()
        self.down = RowParallelLinear(cfg.ffn, cfg.hidden, pstate, bias=cfg.bias,
                                      init_std=std / math.sqrt(2 * cfg.n_layers))

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        if self.gate is not None:
            gate, up = column_parallel_linears(x, self.tp_group, sequence_parallel,
                                               self.gate.weight_and_bias(), self.up.weight_and_bias())
            y = F.silu(gate) * up
        else:
            y = F.gelu(self.up(x, sequence_parallel),
                       approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down(y, sequence_parallel)
