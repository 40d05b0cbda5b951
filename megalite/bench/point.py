"""One benchmark point, on every rank of a torchrun launch (megalite bench starts it):

    torchrun --standalone --nproc_per_node W -m megalite.bench.point SPEC.json

SPEC names the run config, its overrides, the warm-up and timed steps and where rank 0 writes
the result. The step is the trainer's own (`train_step` through the configured engine), on
random full-length token rows made once, so no data loading or padding is timed. Then one more
step runs under a CommLog, which counts every collective by process group and times each one
synchronously: the compute / communication split comes from that step.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.bench.comm import CommLog
from megalite.bench.timing import time_steps
from megalite.data.batches import Batch
from megalite.model import GPT
from megalite.model.activation_memory import formula_bytes_per_layer, saved_bytes_per_block
from megalite.parallel.state import ParallelState, init_parallel
from megalite.run_config import Config, load_config
from megalite.training.deepspeed_engine import check_deepspeed
from megalite.training.engine import autocast_for, build_engine, build_model, train_step
from megalite.training.metrics import flops_per_token, matmul_params, peak_flops
from megalite.training.setup import check_batch_layout


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    cfg = load_config(spec["config"], spec["overrides"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_batch_layout(cfg, world)
    check_deepspeed(cfg.train, cfg.model, cfg.parallel.tp, world)
    ps = init_parallel(cfg.parallel, cfg.model)
    try:
        result = measure(cfg, ps, spec["warmup"], spec["steps"])
        if ps.is_main:
            Path(spec["out"]).write_text(json.dumps(result, indent=1))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def measure(cfg: Config, ps: ParallelState, warmup: int, steps: int) -> dict:
    t, seq = cfg.train, cfg.data.seq_len
    model = build_model(cfg, ps)
    model.train()
    engine = build_engine(model, t, ps)
    engine.set_lr(t.lr)
    autocast = autocast_for(ps.device, t.precision)
    rows = torch.Generator().manual_seed(cfg.run.seed + ps.dp_rank)
    n_micro = t.global_batch_size // (t.micro_batch_size * ps.dp_size)
    batches = []
    for _ in range(n_micro):
        ids = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, seq + 1), generator=rows)
        batches.append(Batch(ids[:, :-1], ids[:, 1:]).to(ps.device))
    n_tokens = torch.tensor(float(t.global_batch_size * seq), device=ps.device)

    def step():
        return train_step(engine, batches, n_tokens, autocast)[0]

    step_s, _ = time_steps(step, ps.device, warmup, steps, lambda: _barrier(ps))
    step_s = _max_over_ranks(step_s, ps)
    peak_bytes = _max_over_ranks(_peak_memory(ps.device), ps)

    with CommLog(ps) as log:
        started = time.perf_counter()
        step().item()
        instrumented_s = time.perf_counter() - started
    activations = activation_bytes(cfg, model, batches[0], autocast)

    tokens_per_s = t.global_batch_size * seq / step_s
    flops, peak = flops_per_token(cfg.model, seq), peak_flops(ps.device)
    return {
        "device": device_name(ps.device), "tp": ps.tp_size, "dp": ps.dp_size,
        "devices": ps.world_size, "sequence_parallel": cfg.parallel.sequence_parallel,
        "engine": t.engine, "activation_checkpointing": t.activation_checkpointing,
        "compile": t.compile,
        "precision": "bf16" if isinstance(autocast, torch.autocast) else "fp32",
        "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
        "seq_len": seq, "layers": cfg.model.n_layers, "hidden": cfg.model.hidden,
        "matmul_params": matmul_params(cfg.model), "flops_per_token": flops,
        "step_s": step_s, "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / ps.world_size,
        "tflops_per_device": tokens_per_s * flops / ps.world_size / 1e12,
        "mfu": tokens_per_s * flops / (ps.world_size * peak) if peak else None,
        "peak_memory_gb": peak_bytes / 2**30,
        "memory_kind": "cuda max allocated" if ps.device.type == "cuda" else "process peak RSS",
        "instrumented_step_s": instrumented_s, "comm_s": log.seconds,
        "compute_s": instrumented_s - log.seconds,
        **activations,
        "comm": [{"op": op, "group": group, **v} for (op, group), v in sorted(log.totals().items())],
    }


def activation_bytes(cfg: Config, model: GPT, batch: Batch, autocast) -> dict:
    """What one layer saves for backward on this rank (measured in one forward, at the run's
    precision), next to Korthikanti et al.'s count (16-bit, attention scores not stored, as
    with SDPA); None with activation checkpointing, which hides what a block saves."""
    if model.activation_checkpointing:
        return {"activation_bytes_per_layer": None, "activation_formula_bytes_per_layer": None}
    with autocast:
        measured = saved_bytes_per_block(model, batch.input_ids, labels=batch.labels)
    b, s = batch.input_ids.shape
    return {"activation_bytes_per_layer": max(measured),
            "activation_formula_bytes_per_layer": formula_bytes_per_layer(
                s, b, cfg.model.hidden, cfg.model.n_heads, cfg.parallel.tp,
                cfg.parallel.sequence_parallel, attention_scores=False)}


def _barrier(ps: ParallelState) -> None:
    if dist.is_initialized():
        dist.barrier()


def _max_over_ranks(value: float, ps: ParallelState) -> float:
    """The slowest rank sets the step time; the fullest device sets the memory."""
    if not dist.is_initialized():
        return value
    x = torch.tensor([float(value)], dtype=torch.float64, device=ps.device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def _peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux reports KiB


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads per process)"


if __name__ == "__main__":
    from megalite.cli import run_reporting_errors
    sys.exit(run_reporting_errors(main, sys.argv[1:]))
