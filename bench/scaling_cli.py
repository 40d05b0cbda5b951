"""`python -m bench scale-model`: the scaling model's table against the published rows, or one
layout's predicted throughput (scaling_model.py holds the model, scaling_check.py the check)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.scaling_check import check_file, markdown
from bench.scaling_config import Hardware, load_scaling_file
from bench.scaling_model import (Layout, check_fits, efficiency_from_single_device,
                                          executed_flops_per_step, model_flops_per_step, predict)
from megalite.command_args import command_parser
from megalite.config import Dense, Experts, GroupedQuery, ModelConfig
from megalite.typed_config import ConfigError

LAYOUT_ARGS = ("layers", "hidden", "heads", "seq_len", "vocab", "global_batch", "tp", "gpus")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    scaling = load_scaling_file(args.config)
    checks = check_file(scaling)
    if args.hardware is None:
        text = markdown(checks)
    else:
        text = _predict_layout(args, scaling.profile(args.hardware), checks)
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


def _predict_layout(args, hw: Hardware, checks) -> str:
    missing = [f"--{k.replace('_', '-')}" for k in LAYOUT_ARGS if getattr(args, k) is None]
    if missing:
        raise ConfigError(f"--hardware {hw.name} predicts one layout: also give "
                          f"{' '.join(missing)}")
    if not args.experts and (args.top_k != 2 or args.moe_ffn is not None):
        raise ConfigError("--top-k and --moe-ffn size a mixture of experts: give --experts too")
    model = ModelConfig(vocab_size=args.vocab, max_seq_len=args.seq_len, n_layers=args.layers,
                        hidden=args.hidden, n_heads=args.heads,
                        attention=GroupedQuery(n_kv_heads=args.kv_heads), tie_embeddings=not args.untied,
                        mlp=Experts(experts=args.experts, top_k=args.top_k, expert_ffn_hidden=args.moe_ffn)
                        if args.experts else Dense())
    layout = Layout(model, args.seq_len, args.global_batch, args.micro_batch, args.tp, args.gpus,
                    args.recompute, args.grad_bytes, args.pp, args.virtual_stages, args.cp, args.cp_comm,
                    args.ep)
    check_fits(layout, hw)
    if args.efficiency is not None:
        efficiency, how = args.efficiency, "given"
    elif args.mfu is not None:  # MFU counts model FLOPs; the efficiency, the executed ones too
        efficiency = args.mfu * executed_flops_per_step(layout) / model_flops_per_step(layout)
        how = f"from single-device MFU {args.mfu:.3f}"
    elif args.step_time is not None:
        efficiency = efficiency_from_single_device(layout, hw, args.step_time, args.step_batch)
        how = f"from a single-device step of {args.step_batch} sequences in {args.step_time} s"
    else:
        calibrated = [c for c in checks if c.source.hardware == hw.name]
        if not calibrated:
            raise ConfigError(f"no published row calibrates {hw.name}: give --efficiency, --mfu "
                              f"or --step-time with --step-batch")
        efficiency = calibrated[0].efficiency
        how = f"calibrated on {calibrated[0].source.name}, {calibrated[0].source.calibrate_on}"
    p = predict(layout, hw, efficiency)
    cp = f" x cp={layout.cp} ({layout.cp_comm})" if layout.cp > 1 else ""
    lines = [f"{hw.name}: tp={layout.tp}{cp} x pp={layout.pp} x dp={layout.dp} ({layout.gpus} GPUs), "
             f"{layout.micro_batches} micro-batches of {layout.micro_batch} per step, "
             f"{layout.virtual_stages} model chunk(s) per stage; "
             f"efficiency {efficiency:.3f} ({how})",
             f"compute {p.compute_s:.4g} s, TP comm {p.tp_comm_s:.4g} s, CP comm {p.cp_comm_s:.4g} s, "
             + (f"EP comm {p.ep_comm_s:.4g} s, " if layout.ep > 1 else "") + f"pipeline bubble "
             f"{p.bubble_s:.4g} s, P2P comm {p.p2p_comm_s:.4g} s, DP comm {p.dp_comm_s:.4g} s "
             f"(overlap window {p.overlap_window_s:.4g} s)",
             "| DP all-reduce | step time (s) | tokens/s | model TFLOP/s per GPU | MFU |",
             "|---|---:|---:|---:|---:|"]
    for overlap in (False, True):
        lines.append(f"| {'overlapped' if overlap else 'after backward'} | {p.step_s(overlap):.4g} "
                     f"| {p.tokens_per_s(overlap):,.0f} | {p.tflops_per_gpu(overlap):.1f} "
                     f"| {p.mfu(overlap):.1%} |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("python -m bench scale-model",
                            "Predict the throughput of TP x PP x DP layouts; without --hardware, "
                            "check the model against the published rows of the config.")
    parser.add_argument("--config", default="configs/bench/scaling.yaml",
                        help="hardware profiles and the published rows to check against")
    parser.add_argument("--out", help="also write the table to this file")
    layout = parser.add_argument_group("one layout (all of these with --hardware)")
    layout.add_argument("--hardware", help="a profile of the config, e.g. H100")
    for name in LAYOUT_ARGS:
        layout.add_argument(f"--{name.replace('_', '-')}", type=int)
    layout.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward")
    layout.add_argument("--pp", type=int, default=1, help="pipeline stages")
    layout.add_argument("--virtual-stages", type=int, default=1,
                        help="model chunks per pipeline stage (interleaved 1F1B when > 1)")
    layout.add_argument("--cp", type=int, default=1, help="context-parallel ranks per sequence")
    layout.add_argument("--cp-comm", choices=("all_gather", "p2p"), default="all_gather",
                        help="context parallelism's K/V exchange: all-gathered, or the ring")
    layout.add_argument("--kv-heads", type=int, help="K/V heads (GQA; default: --heads)")
    layout.add_argument("--experts", type=int, default=0,
                        help="a mixture of experts: routed experts per layer (every layer)")
    layout.add_argument("--top-k", type=int, default=2, help="experts per token")
    layout.add_argument("--moe-ffn", type=int, help="an expert's hidden width (default 4 x hidden)")
    layout.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, out of cp x dp")
    layout.add_argument("--untied", action="store_true", help="LM head separate from the embedding")
    layout.add_argument("--recompute", action="store_true", help="full activation recomputation")
    layout.add_argument("--grad-bytes", type=int, choices=(2, 4), default=4,
                        help="bytes per gradient element in the DP reduction")
    efficiency = layout.add_mutually_exclusive_group()
    efficiency.add_argument("--efficiency", type=float, help="fraction of peak on executed FLOPs")
    efficiency.add_argument("--mfu", type=float, help="measured single-device MFU of this model")
    efficiency.add_argument("--step-time", type=float,
                            help="measured single-device step time (s) of --step-batch sequences")
    layout.add_argument("--step-batch", type=int, default=1,
                        help="sequences of the measured --step-time")
    return parser


if __name__ == "__main__":
    from megalite.cli import run_reporting_errors
    sys.exit(run_reporting_errors(main, sys.argv[1:]))
