"""The per-rank state formulas of bench/state_size.py against built models and measurements."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from bench.state_size import (GB, layer_params, model_params, rank_params, state_bytes,
                                       table)
from megalite.config import ParallelConfig
from megalite.run_config import load_model_config
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.run_config import TrainConfig
from megalite.training.build import build_engine
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
LLAMA4 = dataclasses.replace(CONFIGS["llama"], n_layers=4)


@pytest.mark.unit
@pytest.mark.parametrize("cfg", [CONFIGS["gpt2"], CONFIGS["llama"], LLAMA4], ids=["gpt2", "llama", "llama4"])
def test_the_counts_are_the_built_models(cfg):
    model = GPT(cfg, ParallelState(), seed=0)
    assert model_params(cfg) == rank_params(cfg, 1, 1) == sum(p.numel() for p in model.parameters())
    assert layer_params(cfg) == sum(p.numel() for p in model.blocks[0].parameters())


def check_largest_rank(cfg) -> tuple[int, dict]:
    ps = ParallelState.from_world(2, pipeline=ParallelConfig(tp=2, pp=2))
    model = GPT(cfg, ps, seed=0)
    return sum(p.numel() for p in model.parameters()), ps.rank


@pytest.mark.exactness
def test_a_rank_of_tp2xpp2_holds_what_the_formula_says():
    """Its largest rank, within the norms the formula counts as split."""
    held = [n for n, _ in run_distributed(check_largest_rank, 4, LLAMA4)]
    assert abs(max(held) - rank_params(LLAMA4, 2, 2)) <= 2 * LLAMA4.hidden * LLAMA4.n_layers // 2


def check_moment_bytes(cfg) -> int:
    ps = ParallelState.from_world(1)
    model = GPT(cfg, ps, seed=0)
    engine = build_engine(model, TrainConfig(precision="fp32", zero_stage=1), ps)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(model(ids, labels=ids, loss_scale=1 / 16).loss, last=True)
    engine.step()
    return sum(t.numel() * t.element_size() for state in engine.optimizer.state.values()
               for k, t in state.items() if k != "step")


@pytest.mark.exactness
def test_the_distributed_optimizer_keeps_the_moments_the_formula_says():
    """8 bytes per parameter over the dp replicas (the rows rounding aside)."""
    cfg = CONFIGS["gpt2"]
    moments = run_distributed(check_moment_bytes, 4, cfg)
    s = state_bytes(cfg, tp=1, pp=1, dp=4)
    assert s.optimizer_zero0 - s.optimizer_zero1 == pytest.approx(8 * s.params * 3 / 4)
    assert sum(moments) == 8 * s.params
    assert max(moments) <= 8 * s.params / 4 * 1.05


@pytest.mark.unit
def test_the_checkpoint_bytes_are_the_benchmarks_measured_writes():
    """benchmarks/checkpoint: each TP4 rank's bytes written (the kernel's wchar) against
    12 bytes per parameter of its slice."""
    results = json.loads((ROOT / "benchmarks" / "checkpoint" / "results.json").read_text())
    cfg = load_model_config("gpt2-medium", n_layers=results["layers"])
    predicted = state_bytes(cfg, tp=4, pp=1, dp=1).checkpoint / GB
    for row in results["save"]:
        assert row["written_gb"] == pytest.approx(predicted, rel=0.05), row


@pytest.mark.unit
def test_the_docs_table_is_the_formulas():
    assert table() in (ROOT / "docs" / "checkpoints.md").read_text()
