"""Dropout under TP: identical masks on replicated activations, distinct inside split regions;
under PP, each stage its own masks."""
import dataclasses

import pytest

import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.model import GPT
from megalite.parallel.random import TensorParallelRNG, seed_replicated_dropout
from megalite.parallel.state import ParallelState
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, padded_batch, same_on_all_ranks

pytestmark = pytest.mark.exactness


def check_tracker():
    ps = ParallelState.from_world(2)
    torch.manual_seed(0)
    rng = TensorParallelRNG(seed=0, stream=ps.tp_rank)
    with rng.fork():
        inside = torch.rand(8)
    outside = torch.rand(8)
    assert not same_on_all_ranks(inside, ps.tp_group)
    assert same_on_all_ranks(outside, ps.tp_group)
    # fork() leaves the default stream where it was: as if the fork had not happened.
    torch.manual_seed(0)
    assert torch.equal(outside, torch.rand(8))
    # The tracked stream moves on between forks, and its state round-trips.
    state = rng.get_state()
    with rng.fork():
        second = torch.rand(8)
    rng.set_state(state)
    with rng.fork():
        assert torch.equal(second, torch.rand(8))
    assert not torch.equal(inside, second)


def check_model_dropout():
    ps = ParallelState.from_world(2)
    cfg = dataclasses.replace(CONFIGS["llama"], dropout=0.2)
    ids, mask, labels = padded_batch(cfg, "right")
    losses = []
    for _ in range(2):
        torch.manual_seed(1)  # the trainer seeds the default generator the same on all TP ranks
        model = GPT(cfg, ps, seed=4).train()
        loss = model(ids, labels=labels).token_losses.sum()
        loss.backward()
        losses.append(loss.detach())
        # Replicated parameters see the replicated residual stream: if its dropout masks
        # differed between TP ranks, their gradients would too.
        for name, p in model.named_parameters():
            if not hasattr(p, "tp_shard"):
                assert same_on_all_ranks(p.grad, ps.tp_group), name
    assert torch.equal(losses[0], losses[1])
    eval_loss = model.eval()(ids, labels=labels).token_losses.sum()
    assert not torch.allclose(eval_loss, losses[0])
    return dist.get_rank()


def test_tracker_streams_differ_inside_tp_regions_and_match_outside():
    run_distributed(check_tracker, 2)


def test_model_dropout_is_reproducible_and_consistent_across_tp_ranks():
    run_distributed(check_model_dropout, 2)


def check_activation_checkpointing_replays_dropout():
    ps = ParallelState.from_world(2)
    cfg = dataclasses.replace(CONFIGS["llama"], dropout=0.2)
    ids, _, labels = padded_batch(cfg, "right")
    grads = []
    for recompute in (False, True):
        torch.manual_seed(1)
        model = GPT(cfg, ps, seed=4, activation_checkpointing=recompute).train()
        model(ids, labels=labels).token_losses.sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name


def test_activation_checkpointing_recomputes_the_same_dropout_masks():
    run_distributed(check_activation_checkpointing_replays_dropout, 2)


def check_stages_draw_their_own_masks():
    ps = ParallelState.from_world(2, pipeline=ParallelConfig(tp=2, pp=2))
    seed_replicated_dropout(3, ps.pp_rank * ps.dp_size + ps.dp_rank)
    rng = TensorParallelRNG(seed=3, stream=ps.pp_rank * ps.tp_size + ps.tp_rank)
    replicated = torch.rand(8)
    with rng.fork():
        split = torch.rand(8)
    # Ranks 0 and 1 are stage 0's TP pair, ranks 2 and 3 stage 1's.
    draws = {}
    for name, x in (("replicated", replicated), ("split", split)):
        draws[name] = [torch.empty_like(x) for _ in range(4)]
        dist.all_gather(draws[name], x)
    rep, spl = draws["replicated"], draws["split"]
    assert torch.equal(rep[0], rep[1]) and torch.equal(rep[2], rep[3])
    assert not torch.equal(rep[0], rep[2])
    assert all(not torch.equal(spl[i], spl[j]) for i in range(4) for j in range(i))
    # The first stage draws what a run without stages draws.
    torch.manual_seed(3)
    assert torch.equal(rep[0], torch.rand(8))


def test_pipeline_stages_draw_their_own_dropout_masks():
    run_distributed(check_stages_draw_their_own_masks, 4)
