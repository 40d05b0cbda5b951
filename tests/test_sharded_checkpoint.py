"""Sharded checkpoints: written by every rank, its share; loaded at any layout and zero stage.

The original run trains at TP2 x PP2 x DP2 (8 processes) with the distributed optimizer
(zero_stage=1: each DP rank writes its rows of its stage's slices, tied embedding included) and
saves at step 5; runs resumed from it at TP4, TP1 x DP4, CP2 x DP2 and PP4 interleaved continue with its
losses. At one layout a run killed after a checkpoint resumes exactly, bit for bit; a checkpoint in the format written before
sharding (whole tensors in model.safetensors and optimizer.safetensors) resumes as the sharded
one does.
"""
import dataclasses
import shutil
import statistics

import pytest
import torch
from safetensors.torch import save_file

from megalite.training.checkpoint import load_checkpoint
from megalite.typed_config import ConfigError
from tests.support.checkpoints import WeightsOnly, read_whole_state, save_checkpoint
from tests.support.resume import SAVED_AT, args, kill_then_resume, resume_and_compare, uninterrupted
from tests.support.runs import common, train_run

# Eight layers: four stages of two model chunks each.
MODEL = ("model.n_layers=8",)
ORIGINAL = ("parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=2",
            "train.checkpoint_every=5", "train.zero_stage=1", *MODEL)
LAYOUTS = {"tp4": (4, ()), "tp1xdp4": (1, ()), "cp2xdp2": (1, ("parallel.cp=2",)),
           "pp4-interleaved": (1, ("parallel.pp=4", "parallel.pp_schedule=interleaved",
                                   "parallel.virtual_stages=2"))}


@pytest.fixture(scope="module")
def tp2pp2_zero1(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("tp2pp2dp2-zero1")
    train_run(8, common(cache, run_dir, "padded") + list(ORIGINAL))
    return run_dir


@pytest.mark.exactness
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tp2xpp2_zero1_checkpoint_continues_at_another_layout(tmp_path, cache, tp2pp2_zero1,
                                                                layout):
    tp, extra = LAYOUTS[layout]
    checkpoint = tp2pp2_zero1 / "checkpoints" / f"step_{SAVED_AT:08d}"
    resume_and_compare(cache, tp2pp2_zero1, checkpoint, tmp_path / layout, 4, tp, (*extra, *MODEL))


@pytest.mark.e2e
def test_replicas_share_the_writing(tp2dp2_padded):
    """At TP2 x DP2 each of the 4 ranks wrote its file, none more than 1.25 times the median:
    the DP replicas (and TP ranks, for the tensors they both hold) split what they hold."""
    files = sorted((tp2dp2_padded / "checkpoints" / f"step_{SAVED_AT:08d}").glob("*.distcp"))
    sizes = [f.stat().st_size for f in files]
    assert len(sizes) == 4 and max(sizes) <= 1.25 * statistics.median(sizes), sizes


@pytest.mark.e2e
def test_a_run_killed_with_the_distributed_optimizer_resumes_exactly(tmp_path, cache):
    """DP2 with zero_stage=1 (each rank holds half the rows of Adam's state), dropout on."""
    layout = ("parallel.tp=1", "train.zero_stage=1")
    uninterrupted(2, args(cache, tmp_path / "whole", *layout))
    kill_then_resume(cache, tmp_path / "whole", tmp_path / "killed", *layout)


@pytest.mark.unit
def test_a_checkpoint_of_another_model_is_a_config_error(tmp_path):
    """Named key and shapes, before DCP (which would wrap the error in its own exception)."""
    from megalite.model import GPT
    from megalite.parallel.state import ParallelState
    from tests.support.models import CONFIGS
    ps = ParallelState()
    path = save_checkpoint(tmp_path, 1, GPT(CONFIGS["gpt2"], ps), WeightsOnly(), {}, {}, ps, keep=1)
    wider = dataclasses.replace(CONFIGS["gpt2"], hidden=64)
    with pytest.raises(ConfigError, match=r"model/embed.weight has shape \(128, 32\), the model expects \(128, 64\)"):
        load_checkpoint(path, GPT(wider, ps, init=False), ps)


@pytest.mark.exactness
def test_a_checkpoint_of_whole_tensors_still_resumes(tmp_path, cache, tp2pp2_zero1):
    """The format before sharding: the same weights and moments, rewritten as whole tensors,
    resume as the sharded checkpoint does."""
    sharded = tp2pp2_zero1 / "checkpoints" / f"step_{SAVED_AT:08d}"
    whole = tmp_path / "whole-format" / f"step_{SAVED_AT:08d}"
    shutil.copytree(sharded, whole, ignore=shutil.ignore_patterns("*.distcp", ".metadata"))
    for part in ("model", "optimizer"):
        tensors = read_whole_state(sharded, part)
        assert tensors
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(whole / f"{part}.safetensors"))
    resume_and_compare(cache, tp2pp2_zero1, whole, tmp_path / "resumed", 4, 2,
                       ("parallel.pp=2", *MODEL))
    assert all(torch.isfinite(t).all() for t in read_whole_state(whole).values())
