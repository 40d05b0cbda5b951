"""LayerNorm (GPT-2) or RMSNorm (Llama), replicated on every TP rank. Gemma's RMSNorm scales by
(1 + weight), its weight starting at zero: model.norms.weight_offset=1.

Sequence parallel, each rank normalises its own shard of the tokens (a norm is per token) and
the weight's gradient is summed over TP (TensorParallel.sum_grad); so is that of a norm over each
rank's own heads (q/k norms: built with TensorParallel.split_heads())."""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.init import new_param
from megalite.parallel.contexts import WHOLE, TensorParallel


class Norm(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = WHOLE, width: int | None = None,
                 eps: float | None = None):
        """width: what is normalised (default hidden; a head's width for q/k norms, a latent's
        for MLA). eps: default the model's."""
        super().__init__()
        self.kind, self.offset = cfg.norms.kind, cfg.norms.weight_offset
        self.eps = cfg.norms.eps if eps is None else eps
        self.tp, width = tp, cfg.hidden if width is None else width
        self.weight = new_param(width, fill=1.0 - self.offset)
        self.bias = new_param(width) if cfg.norms.kind == "layernorm" and cfg.bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.tp.sum_grad(self.weight)
        dtype = x.dtype
        if self.offset:  # Gemma: (offset + w), and the norm, in fp32 as transformers computes
            x, weight = x.float(), weight.float() + self.offset
        if self.kind == "rmsnorm":
            y = F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        else:
            bias = None if self.bias is None else self.tp.sum_grad(self.bias)
            y = F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
        return y.to(dtype) if self.offset else y
