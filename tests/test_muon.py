"""Muon's step (training/optimizers/muon.py) is torch.optim.Muon's, per logical matrix.

One process, the same gradients: megalite's Muon over a model's blocks equals torch.optim.Muon
over each logical matrix alone (q, out, MLP and router weights whole; the fused K/V weight as
its K and V; stacked experts each), bitwise in fact (asserted to 1e-6), for both update-scale
rules and with or without Nesterov. The parameter groups put embeddings, the head, norms and
biases to AdamW. A checkpoint's optimizer state of another optimizer is refused by name.
"""
import pytest
import torch

from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.run_config import MuonConfig, TrainConfig
from megalite.run_setup import check_same_optimizer
from megalite.training.engine import NativeEngine
from megalite.training.optimizers.build import takes_muon
from megalite.training.optimizers.muon import Muon
from megalite.typed_config import ConfigError
from tests.support.matrix_optimizers import CFG, logical_matrices, refused

pytestmark = pytest.mark.unit

@pytest.mark.parametrize("adjust_lr,nesterov", [("original", True), ("match_rms_adamw", False)])
def test_a_step_is_torch_muon_on_each_logical_matrix(adjust_lr, nesterov):
    model = GPT(CFG, ParallelState(), seed=1)
    muon = MuonConfig(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.05, adjust_lr=adjust_lr)
    engine = NativeEngine(model, TrainConfig(optimizer="muon", lr=1e-3, grad_clip=0.0, muon=muon),
                          ParallelState())
    params = dict(model.named_parameters())
    covered = {n for n, p in params.items() if takes_muon(n, p)}
    assert covered == {n for n, p in params.items() if n.startswith("blocks.") and p.dim() >= 2}
    assert {n.split(".")[-2] + "." + n.split(".")[-1] for n in covered} >= {
        "q_proj.weight", "kv_proj.weight", "out_proj.weight", "router.weight", "experts.up"}
    for name, p in params.items():  # the rest: AdamW
        assert isinstance(engine.optimizer.owner[id(p)], Muon if name in covered else torch.optim.AdamW), name
    reference = {}
    for name in covered:
        for key, take in logical_matrices(name, params[name]).items():
            w = torch.nn.Parameter(take(params[name].detach()).clone())
            reference[key] = (w, take, name, torch.optim.Muon(
                [w], lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.05,
                adjust_lr_fn=adjust_lr))
    torch.manual_seed(0)
    for _ in range(3):
        grads = {n: torch.randn_like(p) for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        engine.set_lr(1e-3)  # the peak: Muon's groups at muon.lr
        engine.optimizer.step()
        for w, take, name, opt in reference.values():
            w.grad = take(grads[name]).clone()
            opt.step()
        for key, (w, take, name, _) in reference.items():
            torch.testing.assert_close(take(params[name].detach()), w.detach(), atol=1e-6, rtol=0,
                                       msg=key)
    assert all(set(engine.optimizer_state(params[n])) == {"momentum_buffer"} for n in covered)
    assert set(engine.optimizer_state(params["embed.weight"])) == {"exp_avg", "exp_avg_sq"}


def test_muon_settings_and_engines_are_checked_before_the_run():
    assert "train.muon.momentum=1.5" in refused("muon", "train.muon.momentum=1.5")
    assert "train.muon.ns_steps=0" in refused("muon", "train.muon.ns_steps=0")
    message = refused("muon", "train.engine=deepspeed")
    assert "train.optimizer=muon with train.engine=deepspeed" in message and "engine=native" in message


def test_another_optimizers_checkpoint_is_refused_by_name_unless_weights_alone():
    muon = TrainConfig(optimizer="muon")
    with pytest.raises(ConfigError) as err:
        check_same_optimizer(muon, {"lr": 1e-3}, "ckpt")  # before train.optimizer: AdamW's
    assert "train.optimizer=adamw" in str(err.value) and "train.optimizer=muon" in str(err.value)
    assert "train.load_optimizer=false" in str(err.value)
    check_same_optimizer(TrainConfig(optimizer="muon", load_optimizer=False), {}, "ckpt")
    check_same_optimizer(muon, {"optimizer": "muon"}, "ckpt")
    check_same_optimizer(TrainConfig(), {}, "ckpt")
