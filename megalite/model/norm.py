"""LayerNorm (GPT-2) or RMSNorm (Llama), replicated on every TP rank.

Sequence parallel, each rank normalises its own shard of the tokens (a norm is per token) and
the weight's gradient is summed over TP (sum_grad_over_shards)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.init import Init, set_init
from megalite.parallel.mappings import sum_grad_over_shards
from megalite.parallel.state import ParallelState


class Norm(nn.Module):
    def __init__(self, cfg: ModelConfig, pstate: ParallelState):
        super().__init__()
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.tp_group = pstate.tp_group
        self.weight = set_init(nn.Parameter(torch.empty(cfg.hidden, device=pstate.device)),
                               Init(fill=1.0))
        self.bias = None
        if cfg.norm == "layernorm" and cfg.bias:
            self.bias = set_init(nn.Parameter(torch.empty(cfg.hidden, device=pstate.device)), Init())

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        weight = sum_grad_over_shards(self.weight, self.tp_group, sequence_parallel)
        if self.kind == "rmsnorm":
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        bias = None if self.bias is None else sum_grad_over_shards(self.bias, self.tp_group,
                                                                   sequence_parallel)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
