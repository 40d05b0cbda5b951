"""TP-invariant init: TP=t shards concatenate to the TP=1 weights bit for bit."""
import weakref

import pytest

import torch

import megalite.parallel.init as init_module
from megalite.model import GPT
from megalite.parallel.sharding import shard_of
from megalite.parallel.state import ParallelState
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, gather_full


def check_init_is_tp_invariant(*tps: int):
    draw_full = init_module.draw_full
    alive: list[weakref.ref] = []

    def tracked_draw(*args):
        # Every full tensor drawn before must be gone by the time the next one is drawn.
        assert all(ref() is None for ref in alive), "two full weights alive at once"
        full = draw_full(*args)
        alive.append(weakref.ref(full))
        return full

    init_module.draw_full = tracked_draw
    for tp in tps:
        ps = ParallelState.from_world(tp)
        for cfg in CONFIGS.values():
            model = GPT(cfg, ps, seed=5)
            refs = dict(GPT(cfg, ParallelState(), seed=5).named_parameters())
            assert sorted(refs) == sorted(name for name, _ in model.named_parameters())
            for name, p in model.named_parameters():
                shard = shard_of(p)
                assert (shard is None) == (p.shape == refs[name].shape), name
                assert torch.equal(gather_full(p.detach(), shard, ps), refs[name].detach()), name
                if shard is not None:
                    assert torch.equal(p.detach(), shard.take(refs[name].detach())), name
    assert len(alive) > 0


@pytest.mark.exactness
def test_tp_shards_concatenate_to_the_tp1_weights():
    run_distributed(check_init_is_tp_invariant, 4, 2, 4)


@pytest.mark.unit
def test_init_depends_on_the_seed_and_not_on_construction_order():
    cfg = CONFIGS["gpt2"]
    a, b, c = (GPT(cfg, ParallelState(), seed=s) for s in (1, 1, 2))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)
    # Two layers' weights of one kind are different draws, not the same stream restarted.
    assert not torch.equal(a.blocks[0].mlp.up.weight, a.blocks[1].mlp.up.weight)
