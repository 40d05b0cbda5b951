"""Adafactor's step (training/optimizers/adafactor.py) is torch.optim.Adafactor's, per logical
matrix.

One process, the same gradients: megalite's Adafactor over a model's matrices equals
torch.optim.Adafactor over each logical matrix alone (the embedding, tied with the head; q, out, MLP and
router weights whole; the fused K/V weight as its K and V; stacked experts each), to 1e-6 over
three steps; its factors are kept one entry per logical matrix; the vectors take AdamW. Its
settings are checked before the run by name.
"""
import pytest
import torch

from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.run_config import AdafactorConfig, TrainConfig
from megalite.training.engine import NativeEngine
from megalite.training.optimizers.adafactor import Adafactor
from tests.support.matrix_optimizers import CFG, logical_matrices, refused

pytestmark = pytest.mark.unit


def test_a_step_is_torch_adafactor_on_each_logical_matrix():
    model = GPT(CFG, ParallelState(), seed=1)
    settings = AdafactorConfig(lr=0.02, beta2_decay=-0.7, eps1=1e-30, eps2=1e-3, d=1.5, weight_decay=0.1)
    engine = NativeEngine(model, TrainConfig(optimizer="adafactor", lr=1e-3, grad_clip=0.0,
                                             adafactor=settings), ParallelState())
    params = dict(model.named_parameters())
    matrices = {n for n, p in params.items() if p.dim() >= 2}
    assert "embed.weight" in matrices  # tied with the head
    for name, p in params.items():  # the vectors: AdamW
        assert isinstance(engine.optimizer.owner[id(p)], Adafactor if name in matrices else torch.optim.AdamW), name
    reference = {}
    for name in matrices:
        for key, take in logical_matrices(name, params[name]).items():
            w = torch.nn.Parameter(take(params[name].detach()).clone())
            reference[key] = (w, take, name, torch.optim.Adafactor(
                [w], lr=0.02, beta2_decay=-0.7, eps=(1e-30, 1e-3), d=1.5, weight_decay=0.1))
    torch.manual_seed(0)
    for _ in range(3):
        grads = {n: torch.randn_like(p) for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        engine.set_lr(1e-3)  # the peak: Adafactor's groups at adafactor.lr
        engine.optimizer.step()
        for w, take, name, opt in reference.values():
            w.grad = take(grads[name]).clone()
            opt.step()
        for key, (w, take, name, _) in reference.items():
            torch.testing.assert_close(take(params[name].detach()), w.detach(), atol=1e-6, rtol=0, msg=key)
    for name in matrices:
        state, p = engine.optimizer_state(params[name]), params[name]
        count = len(logical_matrices(name, p))
        assert state["row_var"].shape[0] == state["col_var"].shape[0] == count, name
        assert state["row_var"].shape[-1] == 1 and state["col_var"].shape[-2] == 1, name
    assert set(engine.optimizer_state(params["norm.weight"])) == {"exp_avg", "exp_avg_sq"}


def test_adafactor_settings_and_engines_are_checked_before_the_run():
    assert "train.adafactor.beta2_decay=0.5 must be <= 0" in refused("adafactor", "train.adafactor.beta2_decay=0.5")
    assert "train.adafactor.lr=0.0 must be > 0" in refused("adafactor", "train.adafactor.lr=0")
    message = refused("adafactor", "train.engine=deepspeed")
    assert "train.optimizer=adafactor with train.engine=deepspeed" in message and "engine=native" in message
