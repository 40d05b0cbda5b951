"""`megalite eval --ckpt CKPT (--text FILE | --chat FILE.jsonl) [--tp N] [--pp N] [--cp N]
[--ep N] [--json]`: the loss of a model on a text, or over the target tokens of conversations,
at any layout training runs (DP over the ranks the others leave).

The file is cut into pieces at line boundaries (megalite/data/text_pieces.py: about 1 MiB
each, the same for any number of ranks; a file under that size is one piece). Each DP rank
reads and tokenizes only its own contiguous block of pieces, so no rank holds the whole text
or its ids; the other ranks of a DP group take the same pieces. Each piece is tokenized on its
own, with the checkpoint's tokenizer as its template says (Llama's bos first; GPT-2's and
megalite's BPE add nothing), and cut into consecutive, non-overlapping windows of the model's
context length, the last one shorter. Every token after the first of its window is predicted
from the ones before it in that window; the loss is the mean over all of them. With experts
split over DP ranks (--ep), whose all-to-alls pair every rank's forwards, each rank tokenizes
its pieces first and runs as many windows as the rank with the most, adding windows without
targets.

--chat: a jsonl of conversations (`messages`, or `prompt` and `completion`), each rendered with
the checkpoint tokenizer's chat template (or --chat-template) exactly as prepare-data renders
it, eos appended; each is a piece, and the loss is the mean over its target tokens (--train-on,
the assistant's turns by default), what training on them minimises. DP rank d takes every
dp-th conversation.
"""
import json
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megalite.command_args import eval_parser
from megalite.config import ParallelConfig
from megalite.data.batches import collate
from megalite.data.chat import (ChatError, ChatTemplate, conversation_of,
                                conversation_tokens, load_chat_template)
from megalite.data.text_pieces import rank_pieces
from megalite.data.tokenizer import TokenizerInfo
from megalite.hf.convert import checkpoint_model_config
from megalite.inference import layout_of, loaded
from megalite.model import GPT
from megalite.parallel.context import context_chunks
from megalite.training.evaluation import all_reduce_loss, loss_sum
from megalite.typed_config import ConfigError

WINDOWS_PER_PASS = 8


def windows_loss(model: GPT, ids: list[int], pad_id: int,
                 targets: Sequence[bool] | None = None) -> torch.Tensor:
    """loss_sum over the windows of one piece's ids, a window per micro-batch, WINDOWS_PER_PASS
    micro-batches per pipelined pass (a pass keeps its activations sent until it ends).
    targets: whether each token is predicted (None: every one; all False: forwards that
    predict nothing, loss and count 0)."""
    ps, length = model.pstate, model.cfg.max_seq_len
    chunks = context_chunks(ps.cp_size, ps.tp_size, model.tp.sequence_parallel)
    total = torch.zeros(2, dtype=torch.float64, device=ps.device)
    per_pass = WINDOWS_PER_PASS * length
    for first in range(0, len(ids), per_pass):  # windows of `length`, the last one shorter
        batches = [collate("padded", [np.asarray(ids[start:start + length])], pad_id, chunks,
                           [None if targets is None else targets[start:start + length]]).to(ps.device)
                   for start in range(first, min(first + per_pass, len(ids)), length)]
        total += loss_sum(model, batches, nullcontext())
    return total


def conversation_pieces(path: Path, template: ChatTemplate, tokenizer: TokenizerInfo,
                        train_on: str, rank: int, size: int) -> Iterator[tuple[list[int], list[bool]]]:
    """Every size-th conversation of a jsonl file from the rank-th, as (ids, targets); a line
    that is not one is an error naming it (an evaluation set is small and meant whole)."""
    with open(path, encoding="utf-8") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    for n, line in lines[rank::size]:
        try:
            yield conversation_tokens(template, tokenizer, conversation_of(json.loads(line)), train_on)
        except (ChatError, json.JSONDecodeError) as err:
            raise ConfigError(f"--chat '{path}' line {n}: {err}: give conversations as "
                              f"{{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} or "
                              f"{{\"prompt\": ..., \"completion\": ...}}") from None


def check_windows_split(max_seq_len: int, parallel: ParallelConfig) -> None:
    """A full window predicts max_seq_len - 1 tokens, widened to whole context-parallel chunks:
    that width must still have positions."""
    chunks = context_chunks(parallel.cp, parallel.tp, parallel.sequence_parallel)
    if -(-(max_seq_len - 1) // chunks) * chunks > max_seq_len:
        raise ConfigError(f"--cp {parallel.cp} cuts each window into {chunks} equal chunks, wider "
                          f"than the model's max_seq_len={max_seq_len} allows: use a --cp whose "
                          f"2 x cp divides {max_seq_len}")


def main(argv: list[str]) -> int:
    args = eval_parser().parse_args(argv)
    parallel = layout_of(args)
    check_windows_split(checkpoint_model_config(Path(args.ckpt)).max_seq_len, parallel)
    flag, source = ("--chat", Path(args.chat)) if args.chat else ("--text", Path(args.text))
    if not source.is_file() or not source.stat().st_size:
        raise ConfigError(f"{flag} '{source}' " + ("is empty: nothing to predict" if source.is_file()
                                                   else "not found"))
    with loaded(Path(args.ckpt), parallel) as (model, tokenizer):
        ps = model.pstate
        total = torch.zeros(2, dtype=torch.float64, device=ps.device)
        if args.chat:
            template = load_chat_template(tokenizer, args.chat_template)
            pieces = conversation_pieces(source, template, tokenizer, args.train_on, ps.dp_rank, ps.dp_size)
        else:
            pieces = ((tokenizer.encode(piece), None)
                      for piece in rank_pieces(source, ps.dp_rank, ps.dp_size))
        if ps.ep_size > 1:  # kept: the windows are counted before the first forward
            length = model.cfg.max_seq_len
            pieces = list(pieces)
            mine = sum(-(-len(ids) // length) for ids, _ in pieces)  # windows
            most = torch.tensor(mine, device=ps.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ps.ep_group)
            # As many windows as the rank with the most: the spare ones without targets.
            spare = (int(most) - mine) * length
            pieces.append(([tokenizer.pad_id] * spare, [False] * spare))
        for ids, targets in pieces:  # without EP one at a time in memory
            total += windows_loss(model, ids, tokenizer.pad_id, targets)
        loss_sum_, count = all_reduce_loss(total, ps).tolist()
        if count == 0:
            raise ConfigError(f"{flag} '{source}' has no token to predict: give a text of "
                              f"two tokens or more" if not args.chat else
                              f"{flag} '{source}' has no target token (--train-on {args.train_on})")
        loss = loss_sum_ / count
        if ps.is_main:
            result = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": int(count)}
            print(json.dumps(result) if args.json else
                  f"loss {loss:.4f}, perplexity {result['ppl']:.2f} over {int(count)} predicted tokens")
    return 0
