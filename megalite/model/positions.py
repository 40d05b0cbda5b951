"""Position information: a learned table (GPT-2) or rotary embeddings (Llama)."""
import math

import torch
from torch import nn

from megalite.config import Llama3Scaling, ModelConfig, YarnScaling
from megalite.parallel.init import new_param
from megalite.parallel.contexts import TensorParallel


class LearnedPositions(nn.Module):
    """GPT-2's position table, replicated on every TP rank (it is small). Sequence parallel, a
    rank looks up the positions of its shard only, so the gradient is summed over TP."""

    def __init__(self, max_seq_len: int, hidden: int, tp: TensorParallel, init_std: float):
        super().__init__()
        self.tp, self.weight = tp, new_param(max_seq_len, hidden, std=init_std)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: [batch, seq] of the whole rows (sequence parallel: this rank takes its shard's)."""
        if self.tp.sharded:
            positions = positions.chunk(self.tp.size, dim=1)[self.tp.rank]
        return nn.functional.embedding(positions, self.tp.sum_grad(self.weight))


class Rotary(nn.Module):
    """Rotary embeddings (Su et al. 2021) in the rotate-half layout that Hugging Face Llama uses.
    The angles are a function of the position alone, so every rank (a TP, CP or pipeline rank, a
    KV-cache step) takes its tokens' angles from its positions. With model.positions.local_theta the
    sliding-window layers turn at a base of their own (Gemma 3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)
        self.factor = attention_factor(cfg)
        local = cfg.positions.local_theta
        self.register_buffer("local_inv_freq", None if local is None else
                             inverse_frequencies(cfg, local), persistent=False)

    def forward(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin of shape [batch, 1, seq, head_dim], broadcast over heads: "global" for
        every layer, "local" for sliding-window layers where they have a base of their own."""
        return {kind: _angles(positions, inv_freq, factor) for kind, inv_freq, factor in
                (("global", self.inv_freq, self.factor), ("local", self.local_inv_freq, 1.0))
                if inv_freq is not None}


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor,
            factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.unsqueeze(-1).float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return angles.cos() * factor, angles.sin() * factor


def inverse_frequencies(cfg: ModelConfig, local_theta: float | None = None) -> torch.Tensor:
    """The angle per position of each pair of head dimensions: theta^(-2i/head_dim), scaled by
    model.positions.scaling; at base local_theta, if given, unscaled (Gemma 3's local layers)."""
    d, scaling = cfg.rotary_dim, cfg.positions.scaling
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    inv_freq = 1.0 / (local_theta or cfg.positions.theta) ** exponents
    if local_theta is not None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling)
    if scaling.kind == "yarn":
        return _yarn(inv_freq, scaling, d, cfg.positions.theta)
    return inv_freq


def _yarn(inv_freq: torch.Tensor, yarn: YarnScaling, d: int, base: float) -> torch.Tensor:
    """YaRN (Peng et al. 2023): pair i of the head turns r_i = L / wavelength_i times over the
    pretraining context L; a pair with r_i >= beta_fast keeps its frequency, one with
    r_i <= beta_slow takes frequency / factor, and between them the two blend by a linear ramp
    over the pair index, its ends floored and ceiled (transformers' truncate)."""

    def pair_of(rotations: float) -> float:  # the (fractional) pair index turning that often
        return d * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_of(yarn.beta_fast)), 0)
    high = min(math.ceil(pair_of(yarn.beta_slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / max(high - low, 0.001)).clamp(0.0, 1.0)
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)


def yarn_scale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times longer: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1 without it)."""
    yarn = cfg.positions.scaling
    if yarn.kind != "yarn":
        return 1.0
    if yarn.attention_factor is not None:
        return yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_scale(yarn.factor, yarn.mscale) / yarn_scale(yarn.factor, yarn.mscale_all_dim)
    return yarn_scale(yarn.factor)


def _llama3(inv_freq: torch.Tensor, llama3: Llama3Scaling) -> torch.Tensor:
    """Llama 3.1's scaling: a frequency whose wavelength fits in the pretraining context
    high_freq_factor times or more is kept (training saw it turn through every angle), one
    that fits fewer than low_freq_factor times is divided by factor (so the longer
    context's angles stay within those seen), and those between blend the two linearly in how
    many times they fit."""
    wavelength = 2 * math.pi / inv_freq
    low, high = llama3.low_freq_factor, llama3.high_freq_factor
    kept = ((llama3.original_max_seq_len / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    # kept is exactly 0 or 1 outside the blend, where this is inv_freq / factor or inv_freq.
    return (1 - kept) * inv_freq / llama3.factor + kept * inv_freq


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [batch, heads, seq, head_dim] by the angles of each token's position."""
    first, second = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)
