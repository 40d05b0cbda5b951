"""The warmup + cosine learning-rate schedule (the optimizers themselves: optimizers/)."""
from __future__ import annotations

import math

from megalite.run_config import TrainConfig


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
