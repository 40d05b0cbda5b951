"""One benchmark point, on every rank of a torchrun launch (`python -m bench sweep` starts it):

    torchrun --standalone --nproc_per_node W -m bench.point SPEC.json

SPEC names the run config, its overrides, the rows (`batch`), the warm-up and timed steps and
where rank 0 writes the result. The step is the trainer's own (`train_step` through the
configured engine), on random token rows made once by the trainer's own collate, so no data
loading is timed: `full` rows are one document each, `packed` rows hold several (doc_ids,
labels -100 across boundaries), so the packed attention path is timed. Then one more step runs
under a CommLog, which counts every collective by process group and times each one
synchronously: the compute / communication split comes from that step; and one more measures
the memory of the LM head and the loss.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench.comm import CommLog
from bench.timing import synchronize, time_steps
from megalite.data.batches import Batch, Samples
from megalite.data.docs import ArrayShard, DocSet, TokenStore
from megalite.fp8.convert import fp8_layers
from megalite.model import GPT
from bench.activation_memory import formula_bytes_per_layer, saved_bytes_per_block
from megalite.parallel.state import ParallelState, init_parallel
from megalite.run_config import Config, load_config
from megalite.training.build import build_engine, build_model, compile_settings
from megalite.training.engine import autocast_for, train_step
from megalite.training.metrics import flops_per_token, matmul_params, peak_flops, peak_memory_bytes
from megalite.plan import validate


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    cfg = load_config(spec["config"], spec["overrides"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world)
    ps = init_parallel(cfg.parallel)
    try:
        result = measure(cfg, ps, spec["warmup"], spec["steps"], spec["batch"])
        if ps.is_main:
            Path(spec["out"]).write_text(json.dumps(result, indent=1))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def measure(cfg: Config, ps: ParallelState, warmup: int, steps: int, batch: str = "full") -> dict:
    t, seq = cfg.train, cfg.data.seq_len
    model = build_model(cfg, ps)
    model.train()
    engine = build_engine(model, t, ps, cfg.parallel)
    engine.set_lr(t.lr)
    autocast = autocast_for(ps.device, t.precision)
    batches = [b.to(ps.device) for b in random_batches(cfg, ps.dp_rank, ps.dp_size, batch)]
    n_tokens = sum(b.target_count() for b in batches).float()
    if ps.dp_size > 1:  # the global batch's real targets, as the trainer counts them
        dist.all_reduce(n_tokens, group=ps.dp_group)

    def step():
        return train_step(engine, batches, n_tokens, autocast, cfg.parallel.pp_schedule)[0]

    # The peak is that of the timed steps on CUDA (time_steps resets the counter before
    # them); on CPU, the process's peak RSS, model building and warm-up included.
    step_s, _ = time_steps(step, ps.device, warmup, steps, lambda: _barrier(ps))
    step_s = ps.reduce_over_ranks(step_s)
    peak_bytes = peak_memory_bytes(ps)

    with CommLog(ps) as log:
        started = time.perf_counter()
        step().item()
        instrumented_s = time.perf_counter() - started
    # Hooks do not fire inside a compiled graph, and a forward without the trainer's arguments
    # would compile a second graph: a compiled model is measured running eagerly.
    with torch.compiler.set_stance("force_eager"):
        activations = activation_bytes(cfg, model, batches[0], autocast)
        head_loss = head_loss_memory(model, step, ps.device)
    if ps.pp_size > 1:  # measured where the head is, on the last stage (None elsewhere: -1)
        head_loss = {k: ps.reduce_over_ranks(-1 if v is None else v) for k, v in head_loss.items()}
        head_loss = {k: None if v < 0 else int(v) for k, v in head_loss.items()}

    tokens_per_s = t.global_batch_size * seq / step_s
    flops, peak = flops_per_token(cfg.model, seq), peak_flops(ps.device)
    return {
        "device": device_name(ps.device), "tp": ps.tp_size, "pp": ps.pp_size, "dp": ps.dp_size,
        "cp": ps.cp_size, "cp_comm": cfg.parallel.cp_comm if ps.cp_size > 1 else None,
        "devices": ps.world_size, "sequence_parallel": cfg.parallel.sequence_parallel,
        **pipeline_fields(cfg, ps),
        "engine": t.engine, "activation_checkpointing": t.activation_checkpointing,
        "compile": compile_label(t), "batch": batch,
        "precision": t.precision if t.precision != "auto" else
                     ("bf16" if isinstance(autocast, torch.autocast) else "fp32"),
        "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
        "seq_len": seq, "layers": cfg.model.n_layers, "hidden": cfg.model.hidden,
        # MFU counts the same FLOPs against the bf16 peak, FP8 or not.
        "fp8": None if t.fp8.recipe == "none" else t.fp8.recipe, "fp8_layers": fp8_layers(model),
        "matmul_params": matmul_params(cfg.model), "flops_per_token": flops,
        "step_s": step_s, "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / ps.world_size,
        "tflops_per_device": tokens_per_s * flops / ps.world_size / 1e12,
        "mfu": tokens_per_s * flops / (ps.world_size * peak) if peak else None,
        "peak_memory_gb": peak_bytes / 2**30,
        "memory_kind": ("cuda max allocated, timed steps" if ps.device.type == "cuda"
                        else "process peak RSS, whole run"),
        **measured_bubble(log, instrumented_s, ps),
        "instrumented_step_s": instrumented_s, "comm_s": log.seconds,
        "compute_s": instrumented_s - log.seconds,
        **activations, **head_loss,
        "comm": [{"op": op, "group": group, **v} for (op, group), v in sorted(log.totals().items())],
    }


def pipeline_fields(cfg: Config, ps: ParallelState) -> dict:
    """The schedule, and its bubble as Narayanan et al. 2021 count it: the idle fraction of an
    ideal step, (p - 1) / (v m) with m micro-batches per DP rank (v = 1 but interleaved); a
    formula, not a measurement."""
    parallel, t = cfg.parallel, cfg.train
    m = t.global_batch_size // (t.micro_batch_size * ps.dp_size)
    if parallel.pp == 1:
        return {"pp_schedule": None, "virtual_stages": None, "pipeline_bubble": None}
    return {"pp_schedule": parallel.pp_schedule, "virtual_stages": parallel.virtual_stages,
            "pipeline_bubble": (parallel.pp - 1) / (parallel.virtual_stages * m)}


def measured_bubble(log: CommLog, instrumented_s: float, ps: ParallelState) -> dict:
    """The pipeline's idle time as measured in the instrumented step: `pipeline_wait_s`, this
    rank's time waiting for its neighbours' activations and gradients (transfers included; the
    result written is rank 0's), and `pipeline_bubble_measured`, that wait over the rest of the
    step (Narayanan et al.'s bubble time over ideal time, which (p-1)/(v m) predicts),
    averaged over all ranks. On CPU the processes share the cores, so a rank waits while
    another computes on its core as well."""
    if ps.pp_size == 1:
        return {"pipeline_wait_s": None, "pipeline_bubble_measured": None}
    wait = log.receive_seconds
    ratio = torch.tensor(wait / (instrumented_s - wait), dtype=torch.float64, device=ps.device)
    dist.all_reduce(ratio)
    return {"pipeline_wait_s": wait, "pipeline_bubble_measured": ratio.item() / ps.world_size}


def random_batches(cfg: Config, dp_rank: int, dp_size: int, batch: str) -> list[Batch]:
    """This DP rank's micro-batches of one step: random tokens collated by the trainer's own
    Samples. full: documents of seq_len + 1 tokens, one per row, no doc_ids. packed: a stream of
    documents of random lengths (geometric, mean seq_len / 4), cut into rows as in training:
    several documents per row, the first and last cut by the row's edges."""
    t, seq = cfg.train, cfg.data.seq_len
    rows = t.global_batch_size // dp_size
    rng = np.random.default_rng([cfg.run.seed, dp_rank])
    if batch == "full":
        tokens = rng.integers(0, cfg.model.vocab_size, rows * (seq + 1))
        offsets = np.arange(0, len(tokens) + 1, seq + 1)
    else:
        tokens = rng.integers(0, cfg.model.vocab_size, rows * seq + 1)
        ends = np.cumsum(rng.geometric(min(1.0, 4 / seq), size=len(tokens)))
        offsets = np.concatenate([[0], ends[ends < len(tokens)], [len(tokens)]])
    samples = Samples(DocSet.whole(TokenStore([ArrayShard(tokens, offsets)])), "padded" if batch == "full" else "packed", seq,
                      pad_id=0)
    return [samples.collate(range(i, i + t.micro_batch_size)) for i in range(0, rows, t.micro_batch_size)]


def activation_bytes(cfg: Config, model: GPT, batch: Batch, autocast) -> dict:
    """What one layer saves for backward on this rank (measured in one forward, at the run's
    precision), next to Korthikanti et al.'s count (16-bit, attention scores not stored, as
    with SDPA); None with activation checkpointing, which hides what a block saves."""
    if model.activation_checkpointing or model.pstate.pp_size > 1:
        # Checkpointing hides what a block saves; a stage's forward alone needs its input.
        return {"activation_bytes_per_layer": None, "activation_formula_bytes_per_layer": None}
    with autocast:
        measured = saved_bytes_per_block(model, batch.input_ids, labels=batch.labels)
    b, s = batch.input_ids.shape
    return {"activation_bytes_per_layer": max(measured),
            "activation_formula_bytes_per_layer": formula_bytes_per_layer(
                s // cfg.parallel.cp, b, cfg.model.hidden, cfg.model.n_heads, cfg.parallel.tp,
                cfg.parallel.sequence_parallel, attention_scores=False)}


def head_loss_memory(model: GPT, step, device: torch.device) -> dict:
    """What the final norm, the LM head and the loss take in one forward and backward, measured
    on the first micro-batch of a training step `step()`, whatever the model computes after its
    last block (from the final norm's input on):

    head_loss_saved_bytes  what autograd saves for backward until the forward returns (each
                           storage once, parameters excluded; under autocast the 16-bit copy
                           of the head's weight is one of them)
    head_loss_peak_bytes   CUDA: the peak allocated above what was allocated when the final
                           norm started, until its input's gradient is complete (saved tensors,
                           transient logits, their gradients); None on CPU

    The saved-tensor hooks are on only after the last block, so they do not see compiled or
    recomputed blocks."""
    cuda = device.type == "cuda"
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    state = {"phase": "before", "baseline": 0, "peak": None}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    counting = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def backward_done(grad):
        # Once per norm call (one, or one per chunk): the counter only grows, the last read is it.
        state["peak"] = torch.cuda.max_memory_allocated(device) - state["baseline"]

    def norm_starts(module, args):
        if state["phase"] == "before":
            if cuda:
                state["baseline"] = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            counting.__enter__()
            state["phase"] = "forward"
        if state["phase"] == "forward" and cuda:
            args[0].register_hook(backward_done)

    def forward_ends(module, args, out):
        if state["phase"] == "forward":
            counting.__exit__(None, None, None)
            state["phase"] = "after"

    if model.norm is None:  # a pipeline stage without the head still takes part in the step
        step()
        return {"head_loss_saved_bytes": None, "head_loss_peak_bytes": None}
    hooks = [model.norm.register_forward_pre_hook(norm_starts),
             model.register_forward_hook(forward_ends)]
    try:
        step()
        synchronize(device)
    finally:
        for h in hooks:
            h.remove()
        forward_ends(None, None, None)  # if the step failed inside the head
    return {"head_loss_saved_bytes": sum(saved.values()), "head_loss_peak_bytes": state["peak"]}


def _barrier(ps: ParallelState) -> None:
    if dist.is_initialized():
        dist.barrier()


def compile_label(t) -> bool | str:
    """train.compile, or how it compiles where that is not torch.compile's default."""
    settings = compile_settings(t) if t.compile else {}
    if "options" in settings:
        return ",".join(f"{k}={v}" for k, v in settings["options"].items())
    return settings.get("mode", t.compile)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads per process)"


if __name__ == "__main__":
    from megalite.cli import run_reporting_errors
    sys.exit(run_reporting_errors(main, sys.argv[1:]))
