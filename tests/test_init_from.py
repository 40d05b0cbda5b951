"""train.init_from: the checkpoint fixes the architecture, the config keeps the training settings.

A model key the config gives is either one of config.TRAINING_SETTINGS (balancing losses, the
routing bias's rate, capacity, dropout), which the run then trains with, or an architecture key,
which must equal the checkpoint's: another value is refused in one line naming the key and both
values (before, every model key was replaced by the checkpoint's in silence, dropout aside).
"""
import json

import pytest
import torch

from megalite.config import TRAINING_SETTINGS, ModelConfig
from megalite.run_config import given_keys, load_config
from megalite.run_setup import with_pretrained
from megalite.typed_config import ConfigError, from_dict, leaves
from tests.support.checkpoints import read_whole_state
from tests.support.runs import common, losses, train_run

pytestmark = pytest.mark.e2e

MOE = ["model.positions.kind=rotary", "model.mlp.activation=swiglu", "model.norms.kind=rmsnorm", "model.bias=false",
       "model.mlp.kind=moe", "model.mlp.experts=4", "model.mlp.top_k=2", "model.mlp.expert_ffn_hidden=32", "model.mlp.router=sigmoid"]
BALANCING = ["model.mlp.aux_loss_coeff=0.01", "model.mlp.bias_update_rate=0.001"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, cache):
    """A tiny MoE trained 2 steps from scratch, without balancing: its last checkpoint."""
    run_dir = tmp_path_factory.mktemp("pretrained")
    train_run(1, common(cache, run_dir, "packed") + MOE + ["train.max_steps=2", "train.checkpoint_every=2"])
    return run_dir / "checkpoints" / "step_00000002"


def fine_tune(cache, run_dir, ckpt, extra: list[str]) -> None:
    # The same model keys as the checkpoint's (common's preset and MOE): given, equal, accepted.
    train_run(1, common(cache, run_dir, "packed") + MOE + extra +
              [f"train.init_from={ckpt}", "train.max_steps=3", "train.checkpoint_every=3"])


def expert_biases(run_dir) -> dict[str, torch.Tensor]:
    state = read_whole_state(run_dir / "checkpoints" / "step_00000003")
    return {k: v for k, v in state.items() if "bias" in k and "router" in k}


def test_balancing_settings_are_honoured_under_init_from(tmp_path, cache, pretrained):
    plain, balanced = tmp_path / "plain", tmp_path / "balanced"
    fine_tune(cache, plain, pretrained, [])
    fine_tune(cache, balanced, pretrained, BALANCING)
    saved = json.loads((balanced / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert saved["config"]["model"]["mlp"]["aux_loss_coeff"] == 0.01
    assert saved["config"]["model"]["mlp"]["bias_update_rate"] == 0.001
    # The auxiliary loss is in the loss, and the routing biases moved (both 0 without).
    assert all(v > 0 for v in losses(balanced, "moe_aux_loss").values())
    assert all(v == 0 for v in losses(plain, "moe_aux_loss").values())
    # The same weights at step 1 (the logged loss is the language model's), then other updates.
    lp, lb = losses(plain), losses(balanced)
    assert lp[1] == lb[1] and lp[2] != lb[2] and lp[3] != lb[3]
    moved, still = expert_biases(balanced), expert_biases(plain)
    assert moved.keys() == still.keys() and moved
    assert all(still[k].abs().max() == 0 and moved[k].abs().max() > 0 for k in moved)


def test_an_architecture_key_unlike_the_checkpoints_is_refused(pretrained):
    argv = [f"train.init_from={pretrained}", "model.n_layers=3", "model.dropout=0.1"]
    with pytest.raises(ConfigError) as err:
        with_pretrained(load_config(None, argv), given_keys(None, argv))
    assert str(err.value).count("\n") == 0
    assert f"train.init_from={pretrained} fixes the architecture" in str(err.value)
    assert "model.n_layers=3 (the checkpoint's: 2)" in str(err.value)
    assert "dropout" not in str(err.value).split("drop the key")[0]  # a training setting: allowed


def test_a_preset_is_given_keys(pretrained):
    """`model=gpt2-small` names an architecture too: its keys are checked like written ones."""
    argv = [f"train.init_from={pretrained}", "model=gpt2-small"]
    with pytest.raises(ConfigError, match=r"model\.n_layers=12 \(the checkpoint's: 2\)"):
        with_pretrained(load_config(None, argv), given_keys(None, argv))


def test_keys_not_given_are_the_checkpoints_and_given_settings_the_configs(pretrained):
    argv = [f"train.init_from={pretrained}", "model.dropout=0.1", "model.mlp.capacity_factor=1.5",
            "model.mlp.kind=moe", "model.mlp.experts=4"]
    model = with_pretrained(load_config(None, argv), given_keys(None, argv)).model
    saved = from_dict(ModelConfig, json.loads((pretrained / "meta.json").read_text())["config"]["model"],
                      "model.")
    assert (model.dropout, model.mlp.capacity_factor) == (0.1, 1.5)
    assert model.n_layers == saved.n_layers == 2 and model.hidden == 32 and model.n_experts == 4
    assert model.mlp.aux_loss_coeff == saved.mlp.aux_loss_coeff == 0.0  # not given: the checkpoint's
    assert set(TRAINING_SETTINGS) < {key for key, _, _ in leaves(model)}


def test_a_slurm_sweep_from_a_checkpoint_writes_configs_its_jobs_accept(tmp_path, pretrained):
    """megalite slurm writes each point's whole config for its job: under train.init_from with
    the checkpoint's architecture (written as the sweep's defaults, every model key would read
    as given and be refused), checked with it (a MoE setting on the default dense model would
    be refused too), and the sweep's training settings kept."""
    from megalite.launch.slurm import write_sweep
    from megalite.launch.sweep import load_sweep
    (tmp_path / "base.yaml").write_text("train: {max_steps: 3}\n")
    (tmp_path / "sweep.yaml").write_text(
        f"name: ft\nbase: {tmp_path / 'base.yaml'}\nrun_root: {tmp_path / 'runs'}\n"
        f"overrides: [train.init_from={pretrained}, model.mlp.aux_loss_coeff=0.01]\n"
        f"grid: {{train.lr: [0.001]}}\nslurm: {{procs_per_node: 1}}\n")
    sweep, runs = load_sweep(tmp_path / "sweep.yaml")
    write_sweep(sweep, runs, "")
    written = runs[0].directory / "config.yaml"
    model = with_pretrained(load_config(written), given_keys(written)).model
    saved = json.loads((pretrained / "meta.json").read_text())["config"]["model"]
    assert (model.n_layers, model.hidden, model.n_experts) == (saved["n_layers"], saved["hidden"], 4)
    assert model.mlp.aux_loss_coeff == 0.01
