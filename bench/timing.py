"""Timing a training step the same way in every benchmark: warm-up calls untimed, then timed
calls ended by a device synchronisation."""
from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device (a no-op on CPU, where every op has finished when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, device: torch.device, warmup: int, steps: int, before_timing=None):
    """(seconds per call of step() over `steps` timed calls, the last call's result). CUDA's
    peak-memory counter is reset before the timed calls; `before_timing()` runs then too (a
    barrier, so that every rank starts the clock together)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    if before_timing is not None:
        before_timing()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for _ in range(steps):
        out = step()
    synchronize(device)
    return (time.perf_counter() - started) / steps, out
