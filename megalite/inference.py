"""What the commands that run a checkpoint forward share (generate, eval): the layout flags and
the checkpoint's model on that layout, its process group destroyed on the way out."""
from __future__ import annotations

import argparse
import dataclasses
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.layout_rules import check_layout
from megalite.data.tokenizer import TokenizerInfo, load_tokenizer
from megalite.hf.convert import checkpoint_model_config
from megalite.model import GPT
from megalite.parallel.state import init_parallel
from megalite.training.checkpoint import load_checkpoint


def add_layout_arguments(parser: argparse.ArgumentParser, cp: bool = False) -> None:
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks (under torchrun; DP over the others)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--pp-layers", type=_layer_counts, default=None,
                        help="layers per stage, e.g. 3,2 (parallel.pp_layers): stages that "
                             "model.n_layers does not divide evenly")
    if cp:
        parser.add_argument("--cp", type=int, default=1,
                            help="context-parallel ranks: each window split over them")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks (a mixture of experts): each MoE layer's "
                             "experts split over them, out of the DP x CP ranks")


def layout_of(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(tp=args.tp, pp=args.pp, pp_layers=args.pp_layers, cp=getattr(args, "cp", 1),
                          ep=args.ep)


@contextmanager
def loaded(ckpt: Path, parallel: ParallelConfig) -> Iterator[tuple[GPT, TokenizerInfo]]:
    """The checkpoint's model (this rank's part of it) and tokenizer, on `parallel`'s layout
    (checked before any collective)."""
    # Forward only, in eval mode: no dropout, which context parallelism would refuse.
    cfg = dataclasses.replace(checkpoint_model_config(ckpt), dropout=0.0)
    tokenizer = load_tokenizer(ckpt)
    check_layout(cfg, parallel, int(os.environ.get("WORLD_SIZE", "1")))
    ps = init_parallel(parallel)
    try:
        model = GPT(cfg, ps, init=False)
        load_checkpoint(ckpt, model, ps)
        yield model, tokenizer
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not layer counts separated by commas, "
                                         f"e.g. 3,2") from None
