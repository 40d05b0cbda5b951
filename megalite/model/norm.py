"""LayerNorm (GPT-2) or RMSNorm (Llama), replicated on every TP rank. Gemma's RMSNorm scales by
(1 + weight), its weight starting at zero: model.norms.weight_offset=1.

Sequence parallel, each rank normalises its own shard of the tokens (a norm is per token) and
the weight's gradient is summed over TP (sum_grad_over_shards)."""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.init import new_param
from megalite.parallel.mappings import sum_grad_over_shards
from megalite.parallel.state import ParallelState


class Norm(nn.Module):
    def __init__(self, cfg: ModelConfig, pstate: ParallelState, width: int | None = None,
                 eps: float | None = None):
        """width: what is normalised (default hidden; a head's width for q/k norms, a latent's
        for MLA). eps: default the model's."""
        super().__init__()
        self.kind, self.offset = cfg.norms.kind, cfg.norms.weight_offset
        self.eps = cfg.norms.eps if eps is None else eps
        self.tp_group = pstate.tp_group
        width = cfg.hidden if width is None else width
        self.weight = new_param(width, device=pstate.device, fill=1.0 - self.offset)
        self.bias = (new_param(width, device=pstate.device)
                     if cfg.norms.kind == "layernorm" and cfg.bias else None)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """sequence_parallel: x is this rank's part of what the weight applies to (a sequence
        shard, or its heads), so the weight's gradient is summed over TP."""
        weight = sum_grad_over_shards(self.weight, self.tp_group, sequence_parallel)
        dtype = x.dtype
        if self.offset:  # Gemma: (offset + w), and the norm, in fp32 as transformers computes
            x, weight = x.float(), weight.float() + self.offset
        if self.kind == "rmsnorm":
            y = F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        else:
            bias = None if self.bias is None else sum_grad_over_shards(self.bias, self.tp_group,
                                                                       sequence_parallel)
            y = F.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)
        return y.to(dtype) if self.offset else y
