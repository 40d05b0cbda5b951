"""A TP x DP model is the single-process model: same init, logits, loss and every gradient.

Each rank builds the TP=1 reference in-process (no process group) and the TP x DP model from
the same seed, runs its DP slice of a padded batch, and compares against the reference:
logits gathered over TP and DP, the loss normalised by the real tokens of the GLOBAL batch,
and every gradient (DP-summed, TP shards gathered). fp32, tolerance 1e-5.
"""
import pytest
import torch.distributed as dist
from torch.testing import assert_close

from megalite.model import GPT
from megalite.parallel.mappings import all_gather
from megalite.parallel.sharding import local_slice, shard_of
from megalite.parallel.state import ParallelState
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, gather_full, padded_batch

pytestmark = pytest.mark.exactness

TOL = dict(atol=1e-5, rtol=1e-5)


def global_mean_loss(model: GPT, ids, mask, labels, ps: ParallelState) -> tuple:
    out = model(ids, attention_mask=mask, labels=labels)
    count = (labels != -100).sum().float()
    if ps.dp_size > 1:
        dist.all_reduce(count, group=ps.dp_group)
    loss = out.token_losses.sum() / count
    loss.backward()
    return out.logits, loss.detach()


def check_parity(config_name: str, tp: int, seed: int = 3):
    cfg = CONFIGS[config_name]
    ps = ParallelState.from_world(tp)
    for side in ("right", "left"):
        ids, mask, labels = padded_batch(cfg, side)
        ref = GPT(cfg, ParallelState(), seed=seed)
        ref_logits, ref_loss = global_mean_loss(ref, ids, mask, labels, ParallelState())

        model = GPT(cfg, ps, seed=seed)
        rows = slice(ps.dp_rank * len(ids) // ps.dp_size, (ps.dp_rank + 1) * len(ids) // ps.dp_size)
        logits, loss = global_mean_loss(model, ids[rows], mask[rows], labels[rows], ps)
        if ps.dp_size > 1:
            dist.all_reduce(loss, group=ps.dp_group)
            logits = all_gather(logits, 0, ps.dp_group)
        real = mask.bool()
        assert_close(model.full_logits(logits)[real], ref.full_logits(ref_logits)[real], **TOL)
        assert_close(loss, ref_loss, **TOL)

        refs = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad
            if ps.dp_size > 1:
                dist.all_reduce(grad, group=ps.dp_group)
            shard = shard_of(p)
            full_grad = refs[name].grad
            assert_close(grad, local_slice(full_grad, p), **TOL,
                         msg=lambda m: f"{side} padding, {name} (local): {m}")
            assert_close(gather_full(grad, shard, ps), full_grad, **TOL,
                         msg=lambda m: f"{side} padding, {name} (gathered): {m}")


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("tp,world", [(1, 2), (2, 2), (4, 4), (2, 4)],
                         ids=["tp1xdp2", "tp2", "tp4", "tp2xdp2"])
def test_tp_dp_model_equals_single_process(config_name, tp, world):
    run_distributed(check_parity, world, config_name, tp)
