"""The trainer with a mixture of experts: expert-parallel layouts train the single process's
model step for step on padded rows (losses, gradient norms, final weights, 1e-5; padding routed
to no expert), an EP2 checkpoint resumes at EP1 and EP4 with the original's losses and generates
at EP2 what one process generates, and the docs' demo-moe command trains like one process.

Top-2 runs EP4 over CP2 x DP2 with the auxiliary-loss-free expert bias, EP2 x TP2 with
sequence parallelism, and EP2 x PP2 (a dense layer on the first stage, an MoE layer on the
second) with the expert bias and a capacity factor (which drops copies at this batch);
top-1 runs EP2, EP4 and EP2 x CP2. Every run with DP > 1 uses the distributed optimizer (the
default there).
"""
from pathlib import Path

import pytest

from megalite.config import ParallelConfig
from megalite.generate import generate
from megalite.inference import loaded
from tests.support.harness import run_distributed
from tests.support.resume import SAVED_AT
from tests.support.runs import (STEPS, assert_docs_command_trains_like_one_process,
                                assert_same_training, common, losses, one_process_runs, train_run)

pytestmark = pytest.mark.exactness

MOE = ["model.mlp.activation=swiglu", "model.mlp.kind=moe", "model.mlp.experts=4", "model.mlp.top_k=2",
       "model.mlp.expert_ffn_hidden=48", "model.mlp.aux_loss_coeff=0.01", "model.mlp.z_loss_coeff=0.001",
       "train.micro_batch_size=2", "train.checkpoint_every=5"]
# layout: (world, its settings, model settings the single-process reference shares)
LAYOUTS = {
    "EP4 x CP2, expert bias": (4, ["parallel.cp=2", "parallel.ep=4"],
                               ["model.mlp.bias_update_rate=0.01"]),
    "EP2 x TP2, SP": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"], []),
    # The first stage's layer is dense (every second layer is MoE), yet it takes part in the
    # expert-bias step.
    "EP2 x PP2, distributed optimizer, capacity, expert bias": (
        4, ["parallel.pp=2", "parallel.ep=2", "train.zero_stage=1"],
        ["model.mlp.capacity_factor=1.0", "model.mlp.every=2", "model.mlp.bias_update_rate=0.01"]),
    "EP2, top-1": (2, ["parallel.ep=2"], ["model.mlp.top_k=1"]),
    "EP4, top-1": (4, ["parallel.ep=4"], ["model.mlp.top_k=1"]),
    "EP2 x CP2, top-1": (2, ["parallel.cp=2", "parallel.ep=2"], ["model.mlp.top_k=1"]),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache):
    runs = one_process_runs(tmp_path_factory)

    def run(model_settings: list[str]):
        return runs(tuple(model_settings), lambda run_dir: common(cache, run_dir, "padded") + MOE
                    + model_settings, "moe-single")
    return run


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_training_equals_one_process(tmp_path, cache, single, layout):
    world, settings, model_settings = LAYOUTS[layout]
    run_dir = tmp_path / "run"
    train_run(world, common(cache, run_dir, "padded") + MOE + settings + model_settings)
    reference = single(model_settings)
    assert_same_training(reference, run_dir)
    for key in ("moe_aux_loss", "moe_load", "moe_dropped"):  # the same routing at every step
        expected, got = losses(reference, key), losses(run_dir, key)
        assert got.keys() == expected.keys() == set(range(1, STEPS + 1)), key
        for step in got:
            same = got[step] == (pytest.approx(expected[step], rel=1e-5) if key == "moe_aux_loss"
                                 else expected[step])
            assert same, (key, step, got[step], expected[step])
    # Padding goes to no expert: a step routes top-k copies of each real token (in padded rows
    # the real tokens are the targets), in every MoE layer.
    tokens, top_k = losses(run_dir, "tokens"), 1 if "top-1" in layout else 2
    for step, load in losses(run_dir, "moe_load").items():
        real = tokens[step] - tokens.get(step - 1, 0)
        assert [sum(layer) for layer in load] == [top_k * real] * len(load), (step, load, real)
    if "capacity" in layout:
        assert sum(losses(run_dir, "moe_dropped").values()) > 0  # the capacity acted
    if "bias" in layout:  # the bias moved the routing: the loads part from the run without it
        unbiased = single([s for s in model_settings if "bias_update" not in s])
        assert losses(run_dir, "moe_load")[STEPS] != losses(unbiased, "moe_load")[STEPS]
    if layout == "EP2 x TP2, SP":
        checkpoint = run_dir / "checkpoints" / f"step_{SAVED_AT:08d}"
        for world, ep in ((1, 1), (4, 4)):
            resumed = tmp_path / f"ep{ep}-resumed"
            train_run(world, common(cache, resumed, "padded") + MOE + [
                f"parallel.ep={ep}", f"train.resume={checkpoint}"])
            expected, got = losses(run_dir), losses(resumed)
            assert sorted(got) == list(range(SAVED_AT + 1, STEPS + 1))
            for step in got:
                assert abs(got[step] - expected[step]) <= 1e-5, (ep, step, got[step], expected[step])
        final = str(run_dir / "checkpoints" / f"step_{STEPS:08d}")
        alone = generated(final, 1)
        assert all(alone) and run_distributed(generated, 2, final, 2, torchrun_env=True) == [alone] * 2


def generated(checkpoint: str, ep: int) -> list[list[int]]:
    """`megalite generate --ep`'s tokens for two prompts (greedy), on this rank."""
    with loaded(Path(checkpoint), ParallelConfig(ep=ep)) as (model, tokenizer):
        return generate(model, [tokenizer.encode(p) for p in ("The", "A list is")], 6,
                        pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)


def test_the_docs_command_trains_like_one_process(tmp_path, cache):
    """docs/parallelism.md's MoE command (configs/demo-moe.yaml at EP2 x TP2 with SP), a few
    steps, gives the single process's losses."""
    assert_docs_command_trains_like_one_process(tmp_path, cache, "parallelism.md",
                                                "## Mixture of experts", "configs/demo-moe.yaml",
                                                moe_load=True)


