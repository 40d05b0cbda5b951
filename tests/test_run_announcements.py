"""What a run says it does at start (issue 59, "say what runs"): the layers FP8 converted (0
included, and why), Muon's matrices and rate beside AdamW's, a warmup the run never leaves,
no samples header without prompts, and a tp error quoting the run's vocabulary."""
import io
from contextlib import redirect_stdout

import pytest

from megalite.config import Dense, ModelConfig
from megalite.fp8.convert import convert_to_fp8, describe_fp8
from megalite.model.mlp import MLP
from megalite.parallel.contexts import WHOLE
from megalite.run_config import Fp8Config, TrainConfig
from megalite.training.optim import describe_schedule
from megalite.typed_config import ConfigError
from tests.support.layers import SINGLE
from tests.support.runs import common, run_train

SMALL = "fp8 tensorwise: 0 of 10 block layers in FP8; in high precision: 10 too small to gain " \
        "(train.fp8.layers=auto, torchao's size filter; train.fp8.layers=all converts them)"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, cache):
    """Two steps of the tiny model with FP8 on its default layers, Muon, common's warmup of 3
    steps and no prompts: (run dir, its stdout lines)."""
    run_dir = tmp_path_factory.mktemp("announced") / "run"
    out = io.StringIO()
    with redirect_stdout(out):
        assert run_train(common(cache, run_dir, "packed") + [
            "parallel.tp=1", "train.max_steps=2", "train.optimizer=muon",
            "train.fp8.recipe=tensorwise", "train.fp8.emulate=true", "sample.prompts=[]"]) == 0
    return run_dir, out.getvalue().splitlines()


@pytest.mark.e2e
def test_fp8_auto_says_it_converted_nothing_on_a_small_model_and_what_to_change(small_run):
    _, lines = small_run
    assert [line for line in lines if line.startswith("fp8 ")] == [SMALL]


@pytest.mark.unit
def test_fp8_names_the_layers_converted_and_why_the_others_stay():
    cfg = ModelConfig(hidden=64, n_heads=4, mlp=Dense(ffn_hidden=128))
    auto = Fp8Config(recipe="rowwise")
    mlp = MLP(cfg, WHOLE)
    assert describe_fp8(mlp, auto, convert_to_fp8(mlp, auto, SINGLE), SINGLE) == (
        "fp8 rowwise: 0 of 2 block layers in FP8; in high precision: 2 too small to gain "
        "(train.fp8.layers=auto, torchao's size filter; train.fp8.layers=all converts them)")
    chosen = Fp8Config(recipe="rowwise", layers="all", exclude=("down",))
    mlp = MLP(cfg, WHOLE)
    assert describe_fp8(mlp, chosen, convert_to_fp8(mlp, chosen, SINGLE), SINGLE) == (
        "fp8 rowwise: 1 of 2 block layers in FP8 (up); in high precision: 1 in train.fp8.exclude")


@pytest.mark.e2e
def test_a_muon_run_says_muon_s_matrices_and_rate_beside_adamw_s(small_run):
    _, lines = small_run
    # The tiny model's blocks: q, kv, out, up and down weights in each of 2.
    assert [line for line in lines if line.startswith("optimizer: ")] == [
        "optimizer: muon for the blocks' 10 weight matrices at lr 0.02 (train.muon.lr), adamw for "
        "the other 22 parameters at lr 0.001 (train.lr); the schedule scales both, the progress "
        "bar shows adamw's"]


@pytest.mark.e2e
def test_a_warmup_the_run_never_leaves_is_said_with_both_values_and_the_fix(small_run):
    _, lines = small_run
    assert [line for line in lines if line.startswith("lr: ")] == [
        "lr: warmup to 0.001 over 3 steps; train.warmup_steps=3 is not below train.max_steps=2, "
        "so the run ends in warmup at lr 0.000667, with no decay: lower train.warmup_steps below 2"]


@pytest.mark.unit
@pytest.mark.parametrize("settings, said", [
    (dict(warmup_steps=15, max_steps=10),
     "warmup to 0.001 over 15 steps; train.warmup_steps=15 is not below train.max_steps=10, so "
     "the run ends in warmup at lr 0.000667, with no decay: lower train.warmup_steps below 10"),
    # The last step at the peak: warmup's end, still no decay.
    (dict(warmup_steps=10, max_steps=10),
     "warmup to 0.001 over 10 steps; train.warmup_steps=10 is not below train.max_steps=10, so "
     "the run ends in warmup at lr 0.001, with no decay: lower train.warmup_steps below 10"),
    (dict(warmup_steps=15, max_steps=100, decay_steps=10),
     "warmup to 0.001 over 15 steps; train.warmup_steps=15 is not below train.decay_steps=10, so "
     "the lr drops from its peak to 0.0001 at once: lower train.warmup_steps below 10"),
    # The first part of a longer schedule (an explicit decay_steps): warmup goes on after it.
    (dict(warmup_steps=15, max_steps=10, decay_steps=100),
     "warmup to 0.001 over 15 steps, cosine to 0.0001 at step 100; the run stops at step 10, "
     "in warmup"),
    (dict(warmup_steps=9, max_steps=10),
     "warmup to 0.001 over 9 steps, cosine to 0.0001 at step 10"),
], ids=["past the end", "to the end", "past the decay", "a longer schedule's start", "within"])
def test_the_schedule_says_where_the_warmup_ends(settings, said):
    assert describe_schedule(TrainConfig(lr=1e-3, min_lr=1e-4, **settings)) == said


@pytest.mark.e2e
def test_no_prompts_print_no_samples_header_nor_write_samples_txt(small_run):
    run_dir, lines = small_run
    assert not [line for line in lines if line.startswith("samples")]
    assert not (run_dir / "samples.txt").exists()
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()  # the run did end


@pytest.mark.e2e
def test_a_tp_that_does_not_split_the_vocabulary_quotes_the_tokenizer_s(tmp_path, cache, monkeypatch):
    """tp=3 splits 6 heads and an MLP of 384, not the tokenizer's 512 tokens (the tiny preset
    says 1000, padded to 1024: not the run's)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError) as err:
        run_train(common(cache, tmp_path / "run", "packed") + [
            "parallel.tp=3", "model.hidden=96", "model.n_heads=6", "train.micro_batch_size=8"])
    assert str(err.value) == (
        "parallel.tp=3 must divide the model's padded vocab (512): use "
        "parallel.tp among [1] (the divisors of the world size 3 that split the model), or a "
        "model.vocab_pad_multiple that is a multiple of 3")
