"""The Megatron MLP: Y = act(X A) with A split by columns, Z = Y B with B split by rows.

The activation is element-wise, so it runs on each rank's columns with no communication: one
all-reduce forward (g, in B) and one backward (the shared f on the input); sequence parallel,
the SP paper's g and g-bar in their place. SwiGLU (Llama) computes silu(X A_gate) * (X A_up),
both column-parallel with the same split (GeGLU, Gemma: tanh GeLU in place of silu).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear, fused_column_parallel
from megalite.parallel.contexts import TensorParallel


def activate(activation: str, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The MLP's element-wise middle (gate: SwiGLU's and GeGLU's second projection)."""
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "geglu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.gelu(up, approximate="tanh" if activation == "gelu_tanh" else "none")


def down_init_std(cfg: ModelConfig) -> float:
    """Projections into the residual stream: GPT-2's init_std / sqrt(2 n_layers)."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ffn: int | None = None):
        """ffn: the hidden width (default cfg.ffn; MoE's shared experts set their own)."""
        super().__init__()
        self.activation = cfg.mlp.activation
        ffn = cfg.ffn if ffn is None else ffn

        def column() -> ColumnParallelLinear:
            return ColumnParallelLinear(cfg.hidden, ffn, tp, bias=cfg.bias, init_std=cfg.init_std)

        self.gate = column() if cfg.gated else None
        self.up = column()
        self.fused_linears = [("gate", "up")] if self.gate is not None else []
        self.down = RowParallelLinear(ffn, cfg.hidden, tp, bias=cfg.bias, init_std=down_init_std(cfg))

    def forward(self, x: torch.Tensor, inputs=None) -> torch.Tensor:
        """inputs: this rank's (model/inputs.RankInputs), which a dense MLP does not read."""
        if self.gate is not None:
            gate, up = fused_column_parallel(x, self.gate, self.up)
        else:
            gate, up = None, self.up(x)
        return self.down(activate(self.activation, up, gate))
