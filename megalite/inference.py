"""What the commands that run a checkpoint forward share (generate, eval): the layout flags and
the checkpoint's model on that layout, its process group destroyed on the way out."""
import argparse
import dataclasses
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.plan import check_layout
from megalite.data.tokenizer import TokenizerInfo, load_tokenizer
from megalite.hf.convert import checkpoint_model_config
from megalite.model import GPT
from megalite.parallel.state import init_parallel
from megalite.training.checkpoint import load_checkpoint


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
        model = GPT(cfg, ps, init=False, parallel=parallel)
        load_checkpoint(ckpt, model, ps)
        yield model, tokenizer
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
