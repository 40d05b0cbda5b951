"""`megalite eval --ckpt CKPT --text FILE [--tp N] [--json]`: the loss of a model on a text.

The file is cut into pieces at line boundaries (megalite/data/text_pieces.py: about 1 MiB
each, the same for any number of ranks; a file under that size is one piece). Each DP rank
reads and tokenizes only its own contiguous block of pieces, so no rank holds the whole text
or its ids; the TP ranks of a DP group take the same pieces. Each piece is tokenized on its
own, with the checkpoint's tokenizer as its template says (Llama's bos first; GPT-2's and
megalite's BPE add nothing), and cut into consecutive, non-overlapping windows of the model's
context length, the last one shorter. Every token after the first of its window is predicted
from the ones before it in that window; the loss is the mean over all of them, summed over
DP ranks.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.cli import command_parser
from megalite.config import ParallelConfig
from megalite.data.text_pieces import rank_pieces
from megalite.data.tokenizer import TokenizerInfo, load_tokenizer
from megalite.hf.convert import checkpoint_model_config
from megalite.model import GPT
from megalite.parallel.state import init_parallel
from megalite.parallel.vocab import IGNORE_INDEX
from megalite.training.checkpoint import load_checkpoint
from megalite.typed_config import ConfigError


@torch.no_grad()
def text_loss(model: GPT, ids: list[int]) -> tuple[float, int]:
    """(sum of next-token losses, number of predicted tokens) over the windows of one piece's
    ids, on this rank alone."""
    ps, length = model.pstate, model.cfg.max_seq_len
    total = torch.zeros(2, dtype=torch.float64, device=ps.device)
    model.eval()
    for start in range(0, len(ids), length):
        window = torch.tensor([ids[start:start + length]], device=ps.device)
        labels = torch.cat([window[:, 1:], torch.full_like(window[:, :1], IGNORE_INDEX)], dim=1)
        losses = model(window, labels=labels).token_losses
        total += torch.stack([losses.sum().double(), torch.tensor(window.shape[1] - 1.0, device=ps.device,
                                                                   dtype=torch.float64)])
    return total[0].item(), int(total[1].item())


def pieces_loss(model: GPT, tokenizer: TokenizerInfo, text_file: Path) -> tuple[float, int]:
    """text_loss summed over this DP rank's pieces of the file, each tokenized as a document
    (one at a time: no rank holds the whole text's ids), then over DP ranks."""
    ps = model.pstate
    total = torch.zeros(2, dtype=torch.float64, device=ps.device)
    for piece in rank_pieces(text_file, ps.dp_rank, ps.dp_size):
        total += torch.tensor(text_loss(model, tokenizer.encode(piece)), dtype=torch.float64,
                              device=ps.device)
    if ps.dp_size > 1:
        dist.all_reduce(total, group=ps.dp_group)
    return total[0].item(), int(total[1].item())


def main(argv: list[str]) -> int:
    parser = command_parser("megalite eval", __doc__)
    parser.add_argument("--ckpt", required=True, help="a checkpoint: RUN_DIR/checkpoints/step_NNNNNNNN")
    parser.add_argument("--text", required=True, help="a UTF-8 text file")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks (under torchrun; DP over the others)")
    parser.add_argument("--json", action="store_true", help='print {"loss", "ppl", "tokens"}')
    args = parser.parse_args(argv)
    ckpt, text_file = Path(args.ckpt), Path(args.text)
    cfg = checkpoint_model_config(ckpt)
    if not text_file.is_file() or not text_file.stat().st_size:
        raise ConfigError(f"--text '{text_file}' " + ("is empty: nothing to predict" if text_file.is_file()
                                                      else "not found"))
    tokenizer = load_tokenizer(ckpt)
    ps = init_parallel(ParallelConfig(tp=args.tp), cfg)
    try:
        model = GPT(cfg, ps, init=False)
        load_checkpoint(ckpt, model, ps)
        loss_sum, count = pieces_loss(model, tokenizer, text_file)
        if count == 0:
            raise ConfigError(f"--text '{text_file}' has no token to predict: give a text of "
                              f"two tokens or more")
        loss = loss_sum / count
        if ps.is_main:
            result = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}
            print(json.dumps(result) if args.json else
                  f"loss {loss:.4f}, perplexity {result['ppl']:.2f} over {count} predicted tokens")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
