"""AdamW with decay / no-decay groups, and the warmup + cosine learning-rate schedule.

AdamW is element-wise, so a rank updating its TP slice computes exactly the slice of the TP=1
update, given the same gradients and the same clipping coefficient.
"""
from __future__ import annotations

import math

import torch

from megalite.run_config import TrainConfig


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # Matrices (linear weights, embeddings) decay; vectors (biases, norm weights) do not.
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2),
                             fused=device.type == "cuda")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine decay from lr to min_lr at decay_steps (or
    max_steps), min_lr after."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.decay_end - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def describe_schedule(cfg: TrainConfig) -> str:
    end = cfg.decay_end
    text = (f"warmup to {cfg.lr:.3g} over {cfg.warmup_steps} steps, cosine to {cfg.min_lr:.3g} "
            f"at step {end}")
    if cfg.max_steps > end:
        return (f"{text}, then {cfg.min_lr:.3g} to step {cfg.max_steps} (train.decay_steps="
                f"{cfg.max_steps} would stretch the decay over the run)")
    if cfg.max_steps < end:
        return f"{text}; the run stops at step {cfg.max_steps}, mid-decay"
    return text
