"""Where a training step's time goes: a torch.profiler summary for the benchmark JSON.

On a GPU the times are the kernels' own (self device time); on CPU the operators' self CPU
time. Each kernel or operator is put in one class by its name: attention, matmul, optimizer,
communication, or elementwise (everything else: norms, activations, copies, the loss). User
annotations (torch.profiler.record_function ranges such as Optimizer.step#AdamW.step) span
kernels and are never counted as kernel time: counted, they doubled the optimizer's share.

The shares are of the unprofiled step time, which the caller measured (the profiler slows the
host: its own overhead is not the device's idle time), and the rows sum to 1: idle is the step
less the kernels, or 0 where the profiled kernels alone take longer than the unprofiled step
(then the kernels' shares are of their own sum). Without the unprofiled time, of the profiled
wall time.
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


def profile_steps(step, device: torch.device, steps: int = 3, top: int = 10,
                  step_s: float | None = None) -> dict:
    """Profile `steps` calls of step() (already warmed up): the top `top` kernels or operators
    by self time, and the share of the step of each class and of idle. step_s: the step's
    unprofiled time, the shares' basis (None: the profiled wall time per step)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_us = (time.perf_counter() - started) * 1e6
    return summarize(prof.key_averages(), cuda, steps, wall_us, top, step_s)


def summarize(events, cuda: bool, steps: int, wall_us: float, top: int = 10,
              step_s: float | None = None) -> dict:
    """The split of profiler averages (`events`, torch's FunctionEventAvg or alike) of `steps`
    steps that took wall_us profiled: see the module's docstring."""
    # On CPU, an operator's self time excludes its children, so the sum counts each
    # microsecond once; profiler bookkeeping rows (no aten/kernel name) are left out.
    events = [e for e in events
              if not getattr(e, "is_user_annotation", False)
              and (e.device_type.name == "CUDA") == cuda and _self_us(e, cuda) > 0
              and (cuda or e.key.startswith("aten::") or classify(e.key) != "elementwise")]
    step_us = steps * step_s * 1e6 if step_s else wall_us
    by_class: dict[str, float] = {}
    for e in events:
        by_class[classify(e.key)] = by_class.get(classify(e.key), 0.0) + _self_us(e, cuda)
    shares, basis = split(by_class, step_us)
    busy = sum(by_class.values())
    ranked = sorted(events, key=lambda e: _self_us(e, cuda), reverse=True)[:top]
    return {"steps": steps, "wall_ms": wall_us / 1e3, "time": "device kernels" if cuda else "CPU operators",
            "basis": "unprofiled step" if step_s else "profiled wall time",
            "step_ms": step_us / steps / 1e3, "kernel_ms_per_step": busy / steps / 1e3,
            "shares": {k: round(v, 4) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
            "top": [{"name": e.key[:120], "class": classify(e.key), "calls": e.count,
                     "ms": _self_us(e, cuda) / 1e3, "share": _self_us(e, cuda) / basis}
                    for e in ranked]}


# A record_function range's name (Optimizer.step#AdamW.step), not a kernel's (whose template
# arguments may hold '#' too, as in {lambda()#3}).
ANNOTATION = re.compile(r"^[\w.]+#[\w.]+$")


def restate(profile: dict, step_s: float) -> dict:
    """A profile written before annotations were left out and shares taken of the unprofiled
    step (benchmarks/results/*-2026-11-26), re-stated from its own numbers: each class's time
    (its share of the profiled wall time), less the annotations its top list shows, as shares
    of the unprofiled step; idle what is left."""
    wall_ms = profile["wall_ms"]
    ms = {k: v * wall_ms for k, v in profile["shares"].items() if k != "idle"}
    annotations = [t for t in profile["top"] if ANNOTATION.match(t["name"])]
    for t in annotations:
        ms[t["class"]] -= t["ms"]
    step_ms = profile["steps"] * step_s * 1e3
    return {"shares": split(ms, step_ms)[0],
            "annotations": [t["name"] for t in annotations],
            "profiled_over_unprofiled": wall_ms / step_ms}


def split(by_class: dict[str, float], step: float) -> tuple[dict[str, float], float]:
    """(each class's share and idle's, summing to 1; the basis): of `step`, the time the steps
    took unprofiled (or profiled), or of the classes' own sum where they take longer."""
    busy = sum(by_class.values())
    basis = max(busy, step)
    return {**{k: v / basis for k, v in by_class.items()}, "idle": 1.0 - busy / basis}, basis


def _self_us(event, cuda: bool) -> float:
    return event.self_device_time_total if cuda else event.self_cpu_time_total


CLASS_ORDER = ("matmul", "elementwise", "attention", "optimizer", "communication", "idle")


def restated_table(paths: list[str]) -> str:
    """Markdown: each profiled row of peer-bench JSON files, its shares as written and as
    re-stated (restate), in percent."""
    import json
    from pathlib import Path
    lines = ["| result | model | rows | system | compiled | profiled / unprofiled step | "
             + " | ".join(CLASS_ORDER) + " | left out |", "|---" * (7 + len(CLASS_ORDER)) + "|"]
    for path in paths:
        result = json.loads(Path(path).read_text())
        for row in result["rows"]:
            if not row.get("profile"):
                continue
            new = restate(row["profile"], row["step_s"])
            cells = [f"{100 * row['profile']['shares'].get(k, 0):.1f} -> {100 * new['shares'].get(k, 0):.1f}"
                     for k in CLASS_ORDER]
            lines.append(f"| {Path(path).parent.name} | {result['model']} | {result['batch']} | "
                         f"{row['system']} | {row['compile']} | {new['profiled_over_unprofiled']:.2f} | "
                         + " | ".join(cells) + f" | {', '.join(new['annotations']) or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """`python -m bench profile-split FILE...`: the re-stated table of peer-bench results."""
    from megalite.command_args import command_parser
    parser = command_parser("python -m bench profile-split",
                            "The profiler's split of each peer-bench row, as written and re-stated: "
                            "of the unprofiled step, user annotations left out (markdown).")
    parser.add_argument("files", nargs="+", help="peer-bench JSON files (benchmarks/results/*/peer-*.json)")
    print(restated_table(parser.parse_args(argv).files), end="")
    return 0
