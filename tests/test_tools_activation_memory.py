"""Activation memory per layer (bench/activation_memory.py): with sequence parallelism the
model stores fewer activations per layer, measured, close to the paper's ratio; the formula
agrees with itself without parallelism.
"""
import pytest
import torch

from bench.activation_memory import formula_bytes_per_layer, saved_bytes_per_block
from megalite.config import ModelConfig, ParallelConfig
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from tests.support.harness import run_distributed


SHAPE = dict(seq=64, batch=2, hidden=32, heads=4)


def measure_activation_bytes(tp: int) -> dict:
    cfg = ModelConfig(vocab_size=128, max_seq_len=SHAPE["seq"], n_layers=2, hidden=SHAPE["hidden"],
                      n_heads=SHAPE["heads"])
    ids = torch.randint(0, 128, (SHAPE["batch"], SHAPE["seq"]), generator=torch.Generator().manual_seed(0))
    per_layer = {}
    for sp in (False, True):
        model = GPT(cfg, ParallelState.from_world(tp), seed=0,
                    parallel=ParallelConfig(tp=tp, sequence_parallel=sp)).train()
        per_layer[sp] = saved_bytes_per_block(model, ids, labels=ids)
    return per_layer


@pytest.mark.exactness
def test_sequence_parallel_stores_fewer_activations_per_layer():
    measured = run_distributed(measure_activation_bytes, 2, 2)[0]
    off, on = measured[False], measured[True]
    assert all(b > 0 for b in off) and all(a < b for a, b in zip(on, off)), measured
    # dropout 0 and causal SDPA (scores not stored): the paper's ratio with a fused attention,
    # (34 / t) / (10 + 24 / t), but for its two dropout masks.
    expected = (formula_bytes_per_layer(**SHAPE, tp=2, sequence_parallel=True, attention_scores=False)
                / formula_bytes_per_layer(**SHAPE, tp=2, attention_scores=False))
    assert abs(on[0] / off[0] - expected) < 0.05, (measured, expected)


@pytest.mark.unit
def test_formulas_agree_without_parallelism():
    one = formula_bytes_per_layer(1024, 4, 768, 12)
    assert one == 1024 * 4 * 768 * (34 + 5 * 12 * 1024 / 768)
    assert formula_bytes_per_layer(1024, 4, 768, 12, tp=1, sequence_parallel=True) == one
    assert (formula_bytes_per_layer(1024, 4, 768, 12, tp=8, sequence_parallel=True)
            == pytest.approx(one / 8))
