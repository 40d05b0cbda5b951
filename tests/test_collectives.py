"""Collectives per transformer layer, counted (bench/comm.py's CommLog): 2 all-reduces forward
and 2 backward (TP > 1)."""
import collections

import pytest

from bench.comm import CommLog
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.typed_config import replaced
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, padded_batch

VARIANTS = {**CONFIGS, "gpt2-gqa1": replaced(CONFIGS["gpt2"], "attention.n_kv_heads", 1)}


def count_collectives(config_name: str, tp: int, sequence_parallel: bool = False) -> dict:
    cfg = VARIANTS[config_name]
    ps = ParallelState.from_world(tp, sequence_parallel=sequence_parallel)
    model = GPT(cfg, ps, seed=0)
    ids, mask, labels = padded_batch(cfg, "right")
    with CommLog(ps) as forward:
        loss = model(ids, labels=labels).token_losses.sum()
    with CommLog(ps) as backward:
        loss.backward()
    return dict(collections.Counter((phase, r["op"], r["ranks"]) for phase, log in
                                    (("forward", forward), ("backward", backward))
                                    for r in log.records))


@pytest.mark.parametrize("config_name,tp,world,per_layer_backward_extra", [
    ("gpt2", 2, 2, 0),
    ("llama", 2, 2, 0),
    # n_kv_heads=2 < tp=4: the two copies of each KV weight sum their gradients, one more
    # all-reduce per layer in backward, over the pair of ranks that share it.
    ("llama", 4, 4, 1),
    # With biases, the KV bias's copies sum theirs too: one more again.
    ("gpt2-gqa1", 2, 2, 2),
])
def test_two_all_reduces_per_layer_each_way(config_name, tp, world, per_layer_backward_extra):
    layers = VARIANTS[config_name].n_layers
    calls = run_distributed(count_collectives, world, config_name, tp)[0]
    expected = {
        # 2 per layer (attention and MLP g) + embedding g + loss (max, target logit, sum-exp)
        ("forward", "all_reduce", tp): 2 * layers + 1 + 3,
        # 2 per layer (attention and MLP f) + the LM head's f
        ("backward", "all_reduce", tp): 2 * layers + 1,
    }
    if per_layer_backward_extra:
        copies = tp // min(tp, VARIANTS[config_name].kv_heads)
        key = ("backward", "all_reduce", copies)
        expected[key] = expected.get(key, 0) + per_layer_backward_extra * layers
    assert calls == expected
