"""Pure bf16 training's checks: a few steps' batches, and the model being its fp32 masters
rounded to bf16, within LOSS_TOLERANCE of autocast."""
import dataclasses

import torch

from megalite.config import ModelConfig
from megalite.data.batches import Batch
from megalite.parallel.state import ParallelState
from megalite.training.engine import NativeEngine
from tests.support.models import CONFIGS, padded_batch


# The global batch: 2 micro-batches of 2 rows per DP rank at DP2.
LENGTHS = (12, 7, 3, 10, 5, 9, 11, 4)
STEPS = 3
# The loss is ~4.6 (log of the vocabulary). pure_bf16 differs from autocast by rounding the
# weights and every activation between ops to bf16 (unit roundoff 2^-9 each) where autocast
# keeps them fp32; over 3 steps that moves the mean token loss by ~3e-3 here (0.07%), while a
# real bug (an unsynced or unscaled gradient, a skipped update) moves it by more than 0.1.
LOSS_TOLERANCE = 0.01


def config(name: str) -> ModelConfig:
    return dataclasses.replace(CONFIGS[name], dropout=0.0)  # no dropout: the runs are comparable


def micro_batches(cfg: ModelConfig, ps: ParallelState) -> tuple[list[Batch], torch.Tensor]:
    """This DP rank's 2 micro-batches of the global batch, and the global batch's token count."""
    ids, _, labels = padded_batch(cfg, "right", LENGTHS)
    per_rank = len(LENGTHS) // ps.dp_size
    rows = slice(ps.dp_rank * per_rank, (ps.dp_rank + 1) * per_rank)
    batches = [Batch(x, y) for x, y in zip(ids[rows].chunk(2), labels[rows].chunk(2))]
    return batches, (labels != -100).sum().float()


def check_model_is_the_rounded_masters(engine: NativeEngine) -> None:
    for p in engine.model.parameters():
        master = engine.master(p)
        if engine.masters is None:
            assert master is p
            continue
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert p.grad is None and master.grad.dtype == torch.float32
        assert torch.equal(p.detach(), master.detach().bfloat16())
        assert all(m.dtype == torch.float32 for m in engine.optimizer_state(p).values())
        assert engine.optimizer_state(p)
