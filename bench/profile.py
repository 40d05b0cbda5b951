"""Where a training step's time goes: a torch.profiler summary for the benchmark JSON.

On a GPU the times are the kernels' own (self device time); on CPU the operators' self CPU
time. Each kernel or operator is put in one class by its name: attention, matmul, optimizer,
communication, or elementwise (everything else: norms, activations, copies, the loss). Idle is
the part of the profiled wall time the device spent in none of them (launch gaps, host waits).
"""
from __future__ import annotations

import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.timing import synchronize

CLASSES = [  # first match wins
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|gloo|c10d", re.I)),
    ("attention", re.compile(r"attention|flash|fmha|sdp|flex", re.I)),
    ("optimizer", re.compile(r"adam|optimizer|_foreach", re.I)),
    # nvjet: cuBLAS's Hopper matmul kernels.
    ("matmul", re.compile(r"gemm|aten::(mm|addmm|bmm|matmul|linear)\b|cutlass|xmma|nvjet|sm\d+_", re.I)),
]


def classify(name: str) -> str:
    return next((label for label, pattern in CLASSES if pattern.search(name)), "elementwise")


def profile_steps(step, device: torch.device, steps: int = 3, top: int = 10) -> dict:
    """Profile `steps` calls of step() (already warmed up): the top `top` kernels or operators
    by self time, and the share of the wall time of each class and of idle."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_us = (time.perf_counter() - started) * 1e6
    # On CPU, an operator's self time excludes its children, so the sum counts each
    # microsecond once; profiler bookkeeping rows (no aten/kernel name) are left out.
    events = [e for e in prof.key_averages()
              if (e.device_type.name == "CUDA") == cuda and _self_us(e, cuda) > 0
              and (cuda or e.key.startswith("aten::") or classify(e.key) != "elementwise")]
    busy = sum(_self_us(e, cuda) for e in events)
    shares: dict[str, float] = {}
    for e in events:
        label = classify(e.key)
        shares[label] = shares.get(label, 0.0) + _self_us(e, cuda) / wall_us
    shares["idle"] = max(0.0, 1.0 - busy / wall_us)
    ranked = sorted(events, key=lambda e: _self_us(e, cuda), reverse=True)[:top]
    return {"steps": steps, "wall_ms": wall_us / 1e3, "time": "device kernels" if cuda else "CPU operators",
            "shares": {k: round(v, 4) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
            "top": [{"name": e.key[:120], "class": classify(e.key), "calls": e.count,
                     "ms": _self_us(e, cuda) / 1e3, "share": _self_us(e, cuda) / wall_us}
                    for e in ranked]}


def _self_us(event, cuda: bool) -> float:
    return event.self_device_time_total if cuda else event.self_cpu_time_total
