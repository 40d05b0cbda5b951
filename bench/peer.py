"""`python -m bench peer`: megalite against Hugging Face transformers, same process, same run.

    python -m bench peer --model gpt2-small --seq-len 1024 --micro-batch 16 --out peer.json
    python -m bench peer --model llama-1b --seq-len 2048 --micro-batch 4 --compile both --out ...

One device, TP=1. Both models get the same shape (HF's config is written by megalite's own
exporter: GPT-2 with gelu_pytorch_tanh and no dropout, Llama with its GQA and rotary), SDPA
attention, the same random token rows, micro-batch, steps, AdamW with the same decay groups
(fused on CUDA), bf16 autocast on GPU (fp32 on CPU), and the same FLOP count (PaLM, megalite's
flops_per_token). Warm-up steps are not timed; timed steps end with a device synchronisation.
megalite steps through its trainer's own `train_step`; HF through `model(input_ids,
labels).loss`; both clip the gradient norm to 1. Eager and torch.compile are reported separately (`--compile`).
`--batch full` (default): one document per row. `--batch packed`: rows of several documents
(bench/point.py's random_batches), megalite given their doc ids (FlexAttention on GPU, a dense
mask on CPU), HF the same document-causal rule as a 4D boolean mask with per-document
position_ids, which gives megalite's logits exactly (tests/test_peer_bench.py): the same work.
`--max-batch` also searches, on a GPU, the largest micro-batch that fits for each system (on
the eager model just timed, doubling from --micro-batch, then bisecting; compiled rows are not
searched: every size would compile again);
`--profile` adds where the time goes (bench/profile.py: top kernels, attention / matmul /
elementwise / optimizer / communication / idle shares).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path

import torch

from bench.point import device_name, random_batches
from bench.profile import profile_steps
from bench.timing import time_steps
from bench.provenance import git_commit
from megalite.command_args import command_parser
from megalite.run_config import load_model_config
from megalite.data.batches import Batch
from megalite.hf.convert import exportable_as
from megalite.model import GPT
from megalite.model.layout import sequence_layout
from megalite.parallel.state import ParallelState
from megalite.run_config import Config, DataConfig, TrainConfig
from megalite.training.engine import NativeEngine, autocast_for, train_step
from megalite.training.metrics import flops_per_token, peak_flops
from megalite.training.optimizers.build import adamw


def megalite_step(cfg, device, compiled: bool):
    model = GPT(cfg, ParallelState(device=device), seed=0)
    if compiled:
        model.compile()  # as train.compile does
    engine = NativeEngine(model, TrainConfig(grad_clip=1.0), ParallelState(device=device))
    autocast = autocast_for(device, "auto")

    def step(batch: Batch) -> torch.Tensor:
        return train_step(engine, [batch], batch.target_count().float(), autocast)[0]
    return step


def hf_step(cfg, device, compiled: bool):
    import transformers
    name, arch = exportable_as(cfg)
    hf_config = transformers.AutoConfig.for_model(**arch.config_to_hf(cfg, {}))
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="sdpa").to(device)
    optimizer = adamw(list(model.parameters()), TrainConfig(), device)
    forward = torch.compile(model) if compiled else model
    autocast = autocast_for(device, "auto")

    made: dict = {}

    def step(batch: Batch) -> torch.Tensor:
        if made.get("rows") is not batch:  # made once per batch of rows, not every step
            made.update(rows=batch, inputs=hf_inputs(batch))
        inputs = made["inputs"]
        with autocast:
            loss = forward(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # megalite clips too
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def hf_inputs(batch: Batch) -> dict:
    """HF's arguments for megalite's rows: packed documents as the dense document-causal mask
    (built on the CPU, where megalite's layout makes it dense) with positions restarting per
    document; labels moved one position right, since HF shifts them itself."""
    layout = sequence_layout(*(None if t is None else t.cpu() for t in
                               (batch.input_ids, None, batch.doc_ids)))
    device = batch.input_ids.device
    return {"input_ids": batch.input_ids,
            "attention_mask": None if layout.mask is None else layout.mask.to(device),
            "position_ids": layout.positions.to(device),
            "labels": torch.nn.functional.pad(batch.labels[:, :-1], (1, 0), value=-100)}


SYSTEMS = {"megalite": megalite_step, "hf": hf_step}


def rows_of(cfg, seq: int, micro: int, batch: str, device) -> Batch:
    """One micro-batch of random rows, `full` or `packed`, as `python -m bench sweep` makes them."""
    run = Config(model=cfg, data=DataConfig(seq_len=seq),
                 train=TrainConfig(micro_batch_size=micro, global_batch_size=micro))
    return random_batches(run, 0, 1, batch)[0].to(device)


def measure(system: str, cfg, device, seq: int, micro: int, warmup: int, steps: int,
            compiled: bool, profiled: bool = False, batch: str = "full",
            max_batch: bool = False) -> dict:
    torch.manual_seed(0)
    step = SYSTEMS[system](cfg, device, compiled)
    rows = rows_of(cfg, seq, micro, batch, device)
    step_s, loss = time_steps(lambda: step(rows), device, warmup, steps)
    # Of the timed steps (time_steps resets the counter before them), before profiling.
    peak_memory_gb = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    tokens_per_s = micro * seq / step_s  # every position is a real token, packed or not
    flops, peak = flops_per_token(cfg, seq), peak_flops(device)
    summary = profile_steps(lambda: step(rows), device, step_s=step_s) if profiled else None
    row = {"system": system, "compile": compiled, "batch": batch, "step_s": step_s, "tokens_per_s": tokens_per_s,
           "tflops": tokens_per_s * flops / 1e12, "mfu": tokens_per_s * flops / peak if peak else None,
           "peak_memory_gb": peak_memory_gb, "final_loss": loss.item(), "profile": summary}
    if max_batch and device.type == "cuda" and not compiled:
        del rows
        row["max_micro_batch"] = largest_micro_batch(_fits(step, cfg, device, seq, batch), start=micro)
    return row


def largest_micro_batch(fits, limit: int = 1024, start: int = 1) -> int:
    """The largest b <= limit with fits(b), given that fits is monotone: doubling from `start`
    (a size expected to fit), then bisection; 0 if not even 1 fits."""
    low, high = 0, min(start, limit)
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _fits(step, cfg, device, seq, batch):
    """One step of the already built eager system at micro-batch b. Its optimizer state exists
    from the timed steps, so one step reaches the peak. Compiled rows are not searched: each
    new size compiles a new graph (the fused head's loop over chunks of b x s tokens), a
    minute or more each on a GPU."""
    def fits(micro: int) -> bool:
        try:
            step(rows_of(cfg, seq, micro, batch, device))
            torch.cuda.synchronize(device)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            gc.collect()  # a failed attempt's tensors, held by its traceback's frames
            torch.cuda.empty_cache()
    return fits


def parser() -> argparse.ArgumentParser:
    parser = command_parser("python -m bench peer", __doc__)
    parser.add_argument("--model", default="gpt2-small", help="a model preset (megalite/presets/)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per row")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per step")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--compile", choices=["off", "on", "both"], default="off",
                        help="torch.compile both models: not, only, or each way")
    parser.add_argument("--batch", choices=["full", "packed"], default="full",
                        help="one document per row, or several with their boundaries")
    parser.add_argument("--max-batch", action="store_true", help="also find the largest micro-batch (GPU)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile 3 steps: top kernels, time per class, idle")
    parser.add_argument("--out", required=True, help="JSON file for the results")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments, the model preset loaded and checked exportable: a ConfigError naming the
    problem before anything is measured (python -m bench gpu-check --dry-run calls this too)."""
    args = parser().parse_args(argv)
    args.cfg = load_model_config(args.model)
    exportable_as(args.cfg)  # a shape HF can build, or a ConfigError naming why not
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    import transformers
    result = {"device": device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
              "transformers": transformers.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_commit": git_commit(), "command": "python -m bench peer " + " ".join(argv),
              "model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "batch": args.batch,
              "warmup": args.warmup, "steps": args.steps, "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for compiled in modes:
        for system in SYSTEMS:
            row = measure(system, args.cfg, device, args.seq_len, args.micro_batch, args.warmup,
                          args.steps, compiled, args.profile, args.batch, args.max_batch)
            result["rows"].append(row)
            print(f"{system:9s} compile={compiled!s:5s} {row['tokens_per_s']:>12,.0f} tokens/s "
                  f"mfu {row['mfu'] if row['mfu'] is not None else '-'}", flush=True)
            gc.collect()  # this system's model and optimizer, before the next one is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if system == "hf":
                megalite, hf = result["rows"][-2:]
                megalite["speedup_over_hf"] = megalite["tokens_per_s"] / hf["tokens_per_s"]
            # After every row: a run stopped at a time limit keeps what it measured.
            out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    from megalite.cli import run_reporting_errors
    sys.exit(run_reporting_errors(main, sys.argv[1:]))
