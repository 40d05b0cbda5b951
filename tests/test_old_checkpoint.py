"""A checkpoint written by b4372df (before the config had sections) resumes, exports and
imports as it did then.

tests/fixtures/b4372df/ holds what b4372df made from its config.yaml in one process (a tiny
MoE with rotary positions, 6 steps, checkpoints every 3): the step-3 checkpoint, the losses
and gradient norms it logged at every step, and `megalite export` of that checkpoint (bf16).
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megalite.hf.convert import export_hf, import_hf
from tests.support.checkpoints import read_whole_state
from tests.support.runs import losses, run_train

FIXTURE = Path(__file__).parent / "fixtures" / "b4372df"


@pytest.mark.exactness
def test_resumes_with_the_losses_it_would_have_had(tmp_path, cache):
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    shutil.copytree(FIXTURE / "checkpoint", ckpt)
    assert run_train(["--config", str(FIXTURE / "config.yaml"), f"run.dir={tmp_path / 'run'}",
                      f"data.cache_dir={cache}"]) == 0
    then = {int(k): v for k, v in json.loads((FIXTURE / "losses.json").read_text())["losses"].items()}
    now, norms = losses(tmp_path / "run"), losses(tmp_path / "run", "grad_norm")
    assert sorted(now) == [4, 5, 6]  # resumed after step 3
    for step in now:
        assert now[step] == pytest.approx(then[step]["loss"], abs=1e-5), step
        assert norms[step] == pytest.approx(then[step]["grad_norm"], rel=1e-4), step


@pytest.mark.unit
def test_exports_as_it_did(tmp_path):
    assert export_hf(FIXTURE / "checkpoint", tmp_path / "hf") == "MixtralForCausalLM"
    then = json.loads((FIXTURE / "hf" / "config.json").read_text())
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == then
    old, new = load_file(FIXTURE / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert old.keys() == new.keys()
    for name in old:
        assert torch.equal(old[name], new[name]), name


@pytest.mark.unit
def test_its_export_imports_to_its_weights(tmp_path):
    import_hf(FIXTURE / "hf", tmp_path / "ckpt")
    imported, saved = read_whole_state(tmp_path / "ckpt"), read_whole_state(FIXTURE / "checkpoint")
    assert imported.keys() == saved.keys()
    for name in saved:  # the export is bf16: the import is the checkpoint's weights rounded so
        torch.testing.assert_close(imported[name], saved[name].to(torch.bfloat16).float(),
                                   atol=0, rtol=0, msg=name)
