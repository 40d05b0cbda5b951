"""LayerNorm (GPT-2) or RMSNorm (Llama), replicated on every TP rank."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.init import Init, set_init


class Norm(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device):
        super().__init__()
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.weight = set_init(nn.Parameter(torch.empty(cfg.hidden, device=device)), Init(fill=1.0))
        self.bias = None
        if cfg.norm == "layernorm" and cfg.bias:
            self.bias = set_init(nn.Parameter(torch.empty(cfg.hidden, device=device)), Init())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
