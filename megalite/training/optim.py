"""The warmup + cosine learning-rate schedule (the optimizers themselves: optimizers/)."""
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
    """The start's lr line (decay_steps resolved: run_setup.with_schedule)."""
    end, warmup = cfg.decay_end, cfg.warmup_steps
    if warmup >= end:
        # Not refused: short runs of longer configs (tests, README's shortened demo) do this.
        key = "train.max_steps" if end == cfg.max_steps else "train.decay_steps"
        after = (f"the run ends in warmup at lr {lr_at(cfg.max_steps - 1, cfg):.3g}, with no decay"
                 if cfg.max_steps <= warmup else
                 f"the lr drops from its peak to {cfg.min_lr:.3g} at once")
        return (f"warmup to {cfg.lr:.3g} over {warmup} steps; train.warmup_steps={warmup} is not "
                f"below {key}={end}, so {after}: lower train.warmup_steps below {end}")
    text = (f"warmup to {cfg.lr:.3g} over {warmup} steps, cosine to {cfg.min_lr:.3g} "
            f"at step {end}")
    if cfg.max_steps > end:
        return (f"{text}, then {cfg.min_lr:.3g} to step {cfg.max_steps} (train.decay_steps="
                f"{cfg.max_steps} would stretch the decay over the run)")
    if cfg.max_steps < end:
        return (f"{text}; the run stops at step {cfg.max_steps}, "
                f"{'in warmup' if cfg.max_steps <= warmup else 'mid-decay'}")
    return text
