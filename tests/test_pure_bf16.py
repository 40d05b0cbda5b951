"""train.precision=pure_bf16 (training/mixed_precision.py): bf16 model, fp32 masters, Adam and
gradient sums.

Over a few optimizer steps, single-process and at TP2xDP2 with 2 accumulation micro-batches, the
loss follows bf16 autocast's to bf16 tolerance; the model's parameters are bf16, the masters,
their gradients and Adam's moments fp32; micro-batch gradients are summed in fp32; after each
step the model holds the masters rounded to bf16, exactly. At TP1xDP2 the synced master
gradients are the per-rank ones summed. DeepSpeed refuses the mode before launch. Through the
trainer, checkpoints hold the fp32 masters and resume exactly.
"""
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megalite.config import ModelConfig, ParallelConfig
from megalite.data.batches import Batch
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.run_config import TrainConfig
from megalite.plan import raise_problems
from megalite.training.deepspeed_engine import deepspeed_problems
from megalite.training.engine import NativeEngine, autocast_for, train_step
from megalite.training.mixed_precision import MasterWeights
from megalite.typed_config import ConfigError
from tests.support.bf16 import (LOSS_TOLERANCE, STEPS, check_model_is_the_rounded_masters, config,
                                micro_batches)
from tests.support.checkpoints import read_whole_state
from tests.support.harness import run_distributed


def train(name: str, ps: ParallelState, precision: str) -> tuple[list[float], NativeEngine]:
    """The global loss of each of STEPS optimizer steps on the same batch, and the engine."""
    cfg = config(name)
    engine = NativeEngine(GPT(cfg, ps, seed=0), TrainConfig(precision=precision), ps)
    autocast = autocast_for(ps.device, precision)
    losses = []
    for _ in range(STEPS):
        engine.set_lr(1e-2)
        batches, n_tokens = micro_batches(cfg, ps)
        loss, _ = train_step(engine, batches, n_tokens, autocast)
        if ps.dp_size > 1:
            dist.all_reduce(loss, group=ps.dp_group)
        losses.append(loss.item())
        check_model_is_the_rounded_masters(engine)
    return losses, engine


def check_losses_follow_autocast(name: str, ps: ParallelState) -> None:
    fp32, _ = train(name, ps, "fp32")
    autocast, _ = train(name, ps, "bf16")
    pure, _ = train(name, ps, "pure_bf16")
    assert fp32[-1] < fp32[0] and pure[-1] < pure[0]  # it trains
    assert_close(torch.tensor(pure), torch.tensor(autocast), atol=LOSS_TOLERANCE, rtol=0)
    assert_close(torch.tensor(pure), torch.tensor(fp32), atol=LOSS_TOLERANCE, rtol=0)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_pure_bf16_trains_like_autocast_single_process(name):
    check_losses_follow_autocast(name, ParallelState())


@pytest.mark.exactness
def test_pure_bf16_trains_like_autocast_at_tp2xdp2():
    run_distributed(check_tp2xdp2, 4)


def check_tp2xdp2() -> None:
    check_losses_follow_autocast("llama", ParallelState.from_world(2))


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_micro_batch_gradients_are_summed_in_fp32(name):
    """The masters' gradient after 2 micro-batches is the fp32 sum of each one's bf16 gradient,
    exactly, and the gradient of one micro-batch of both to bf16 rounding."""
    cfg, ps = config(name), ParallelState()
    engine = NativeEngine(GPT(cfg, ps, seed=0), TrainConfig(precision="pure_bf16"), ps)
    model, params = engine.model, list(engine.model.parameters())
    batches, n_tokens = micro_batches(cfg, ps)

    def bf16_grads(batch: Batch) -> list[torch.Tensor]:
        loss = model(batch.input_ids, labels=batch.labels).token_losses.sum() / n_tokens
        return torch.autograd.grad(loss, params)

    each = [bf16_grads(b) for b in batches]
    both = bf16_grads(Batch(torch.cat([b.input_ids for b in batches]),
                            torch.cat([b.labels for b in batches])))
    for i, batch in enumerate(batches):
        loss = model(batch.input_ids, labels=batch.labels).token_losses.sum() / n_tokens
        engine.backward(loss, last=i == 1)
    bf16_sums_differ = False
    for p, g0, g1, g in zip(params, *each, both):
        main = engine.master(p).grad
        assert g0.dtype == torch.bfloat16 and main.dtype == torch.float32 and p.grad is None
        assert torch.equal(main, g0.float() + g1.float())
        bf16_sums_differ |= not torch.equal(main, (g0 + g1).float())
        # Both are bf16 backward passes, whose roundings (2^-9 relative each) differ with the
        # batch shape and with the CPU kernels' thread count: equal as a whole to a few bf16
        # roundings per layer, not element by element (on one thread a norm weight's gradient
        # differs by 1.5%, on two by less).
        assert (main - g.float()).norm() <= 2**-5 * main.norm(), p.shape
    assert bf16_sums_differ  # so the check above tells fp32 from bf16 accumulation
    engine.step()
    check_model_is_the_rounded_masters(engine)


def check_dp_sync_sums_master_gradients() -> None:
    ps = ParallelState.from_world(1)
    cfg = config("llama")
    engine = NativeEngine(GPT(cfg, ps, seed=0), TrainConfig(precision="pure_bf16"), ps)
    # The same model and masters without the DP sync: this rank's gradients alone.
    alone = GPT(cfg, ps, seed=0)
    masters = MasterWeights(alone)
    masters.accumulate_grads(then=lambda master: None)
    batches, n_tokens = micro_batches(cfg, ps)
    for i, batch in enumerate(batches):
        for model, backward in ((engine.model, lambda loss: engine.backward(loss, last=i == 1)),
                                (alone, torch.Tensor.backward)):
            backward(model(batch.input_ids, labels=batch.labels, loss_scale=1.0 / n_tokens).loss)
    engine.grad_sync.wait()
    for p, q in zip(engine.model.parameters(), alone.parameters()):
        expected = masters.master(q).grad.clone()
        dist.all_reduce(expected, group=ps.dp_group)
        assert torch.equal(engine.master(p).grad, expected)
        assert not torch.equal(engine.master(p).grad, masters.master(q).grad)


@pytest.mark.exactness
def test_dp_sync_sums_the_master_gradients_at_tp1xdp2():
    run_distributed(check_dp_sync_sums_master_gradients, 2)


@pytest.mark.unit
def test_deepspeed_refuses_pure_bf16_before_launch():
    train_cfg = TrainConfig(engine="deepspeed", precision="pure_bf16", global_batch_size=16,
                            micro_batch_size=4)
    with pytest.raises(ConfigError, match="train.precision=pure_bf16 needs train.engine=native"):
        raise_problems(deepspeed_problems(train_cfg, ModelConfig(), ParallelConfig(tp=2), 4))


@pytest.mark.exactness
def test_trainer_saves_the_fp32_masters_and_resumes_exactly(tmp_path, cache):
    """Through megalite.train: the checkpoint holds the fp32 master weights (not the bf16
    model), a run resumed from it continues with the uninterrupted run's losses, and sampling
    (bf16 KV cache) works at the end."""
    from tests.support.runs import common, losses, train_run
    run = common(cache, tmp_path / "a", "packed") + ["train.precision=pure_bf16", "train.max_steps=6",
                                                      "train.checkpoint_every=3"]
    train_run(1, run)
    step3 = tmp_path / "a" / "checkpoints" / "step_00000003"
    weights = read_whole_state(step3)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    # Masters that were only ever rounded bf16 would fit in bf16 exactly.
    assert any(not torch.equal(t, t.bfloat16().float()) for t in weights.values())
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(step3, tmp_path / "b" / "checkpoints" / step3.name)
    train_run(1, [arg.replace(str(tmp_path / "a"), str(tmp_path / "b")) for arg in run])
    resumed = losses(tmp_path / "b")
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {s: v for s, v in losses(tmp_path / "a").items() if s > 3}
    assert (tmp_path / "b" / "samples.txt").read_text()


@pytest.mark.unit
def test_gemma_norms_scale_by_one_plus_weight_in_fp32_under_bf16_weights():
    """(1 + w) in bf16 would round w = 0.003 away (steps of 2^-7 near 1): transformers and
    megalite compute the offset and the norm in fp32, then cast."""
    from megalite.config import ModelConfig, Norms
    from megalite.model.norm import Norm
    norm = Norm(ModelConfig(norms=Norms(kind="rmsnorm", weight_offset=1.0), hidden=8))
    with torch.no_grad():
        norm.weight.fill_(0.003)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = (torch.nn.functional.rms_norm(x.float(), (8,), eps=1e-5) * 1.003).to(torch.bfloat16)
    assert torch.equal(norm.to(torch.bfloat16)(x), expected)


@pytest.mark.unit
def test_a_norm_offset_scales_a_layernorm_too():
    """model.norms.weight_offset is the norm's, whichever kind: a LayerNorm scales by offset + w
    (it ran as an RMSNorm before)."""
    from megalite.config import ModelConfig, Norms
    from megalite.model.norm import Norm
    norm = Norm(ModelConfig(norms=Norms(kind="layernorm", weight_offset=1.0), hidden=8))
    with torch.no_grad():
        norm.weight.fill_(0.5)
        norm.bias.fill_(0.25)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.layer_norm(x, (8,), torch.full((8,), 1.5), torch.full((8,), 0.25))
    torch.testing.assert_close(norm(x), expected)
