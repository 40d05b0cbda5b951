"""On a GPU: each CUDA-only path of the model against the path a CPU takes, or a reference.

- NCCL at TP=1 = the fp32 CPU model (padded rows, SDPA), and bf16 autocast trains;
- packed rows: compiled FlexAttention (model/doc_attention.py, CUDA only) = the dense-mask SDPA
  path that CPUs take, logits, losses and gradients, in fp32 and in bf16 autocast, GPT-2 style
  (learned positions, tied head) and Llama style (RoPE, GQA, untied head);
- train.compile (the model's .compile(), inductor) = eager, packed rows through FlexAttention;
  with train.compile_mode=reduce-overhead (CUDA graphs) a few optimizer steps train as eager;
- train.precision=pure_bf16 follows bf16 autocast (and fp32) over a few optimizer steps.

The kernels the model calls (the fused head + loss, the KV cache, the MoE grouped matmul) are
checked in tests/test_gpu_kernels.py.

Skipped where there is no CUDA device; on a GPU machine: `python -m pytest -o addopts=
tests/test_gpu.py -q` (one process: no pytest-xdist needed); `python -m bench gpu-check` runs it
with tests/test_gpu_kernels.py and tests/test_gpu_train.py. Each check is a function of the
device, so its logic can be exercised on a CPU as well (FlexAttention there through
tests/test_doc_attention.py's flex_on_cpu, the compile with a cheap backend).

FlexAttention's Triton kernels need head dims of at least 16 (tl.dot); the shared test
configs have hidden 32 over 4 heads (8), so the packed-row checks widen them to hidden 64.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from contextlib import contextmanager, nullcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megalite.model import GPT, attention as attention_module, doc_attention
from megalite.parallel.state import ParallelState
from megalite.run_config import TrainConfig
from megalite.training.build import compile_settings
from megalite.training.engine import NativeEngine, autocast_for, train_step
from tests.support.attention import packed_batch
from tests.support.bf16 import (LOSS_TOLERANCE, STEPS, check_model_is_the_rounded_masters,
                                config as pure_bf16_config, micro_batches)
from tests.support.gpu import CUDA, assert_relative_norm
from tests.support.models import CONFIGS, padded_batch

# no_tf32 (tests/conftest.py): fp32 matmuls in full fp32 in every test here.
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("no_tf32"),
              pytest.mark.exactness]

# Packed rows one token past FlexAttention's 128-token block: its last block is partial.
FLEX_SEQ = 130


@pytest.fixture(scope="module")
def nccl_state():
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield ParallelState.from_world(1, device=torch.device("cuda", 0))
    dist.destroy_process_group()


def assert_close_scaled(got: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Elementwise within tol relative to each element, or tol relative to the tensor's largest
    element: fp32 rounding differences scale with the magnitudes summed, not with the result
    (a gradient entry near 0 is a sum of larger terms)."""
    got, expected = got.detach().float().cpu(), expected.detach().float().cpu()
    assert_close(got, expected, rtol=tol, atol=tol * float(expected.abs().max()),
                 msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("side", ["right", "left"])
def test_gpu_model_matches_cpu_in_fp32_and_trains_in_bf16(nccl_state, config_name, side):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = CONFIGS[config_name]
    ids, mask, labels = padded_batch(cfg, side)
    cpu = GPT(cfg, ParallelState(), seed=2)
    gpu = GPT(cfg, nccl_state, seed=2)
    cpu_out = cpu(ids, attention_mask=mask, labels=labels)
    cuda = [t.cuda() for t in (ids, mask, labels)]
    gpu_out = gpu(cuda[0], attention_mask=cuda[1], labels=cuda[2])
    real = mask.bool()
    assert_close(gpu.full_logits(gpu_out.logits).cpu()[real], cpu.full_logits(cpu_out.logits)[real],
                 atol=1e-4, rtol=1e-4)
    cpu_out.token_losses.sum().backward()
    gpu_out.token_losses.sum().backward()
    for (name, p), q in zip(gpu.named_parameters(), cpu.parameters()):
        assert_close(p.grad.cpu(), q.grad, atol=1e-4, rtol=1e-4, msg=name)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = gpu(cuda[0], attention_mask=cuda[1], labels=cuda[2])
    count = (labels != -100).sum()
    assert_close(bf16.token_losses.sum().cpu() / count, cpu_out.token_losses.sum().detach() / count,
                 atol=0.05, rtol=0.02)
    bf16.token_losses.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters())


# ---------------------------------------------------------------------------------------------
# Packed rows: FlexAttention = the dense mask.

def flex_config(name: str, **overrides):
    """A test config whose heads FlexAttention's kernels take (head dim 16), long enough for
    FLEX_SEQ."""
    return dataclasses.replace(CONFIGS[name], hidden=64, max_seq_len=160, **overrides)


@contextmanager
def counting_flex():
    """Records the dtype of each call of FlexAttention by the attention layers."""
    calls = []
    real = attention_module.flex

    def spy(q, *args, **kwargs):
        calls.append(q.dtype)
        return real(q, *args, **kwargs)

    with mock.patch.object(attention_module, "flex", spy):
        yield calls


def forward_backward(model: GPT, batch: tuple, autocast) -> dict:
    """The training path (loss_scale: the fused head makes its gradients in forward): the loss,
    per-token losses, logits (real vocab columns) and every gradient."""
    ids, mask, docs, labels = batch
    count = (labels != -100).sum()
    with autocast:
        out = model(ids, attention_mask=mask, doc_ids=docs, labels=labels, loss_scale=1.0 / count)
        logits = out.logits[..., : model.cfg.vocab_size].float()
    out.loss.backward()
    return {"loss": out.loss.detach(), "token losses": out.token_losses.detach(),
            "logits": logits.detach(),
            **{f"grad {n}": p.grad.detach().clone() for n, p in model.named_parameters()}}


def flex_and_dense(device: torch.device, name: str, masked: bool, bf16: bool) -> tuple[dict, dict]:
    """The same model and packed rows through FlexAttention (the path on CUDA) and through the
    dense mask (FLEX_DEVICES emptied: the path on CPU), on `device`."""
    cfg = flex_config(name)
    ids, mask, docs, labels = (t.to(device) for t in packed_batch(cfg.vocab_size, FLEX_SEQ))
    # masked: pads inside rows (packed_batch's rows 2 and 3); unmasked: the trainer's rows,
    # doc ids only.
    batch = (ids, mask if masked else None, docs, labels)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    ps = ParallelState(device=device)
    with counting_flex() as calls:
        flex = forward_backward(GPT(cfg, ps, seed=3), batch, autocast)
    assert calls == [torch.bfloat16 if bf16 else torch.float32] * cfg.n_layers
    with counting_flex() as calls, mock.patch.object(doc_attention, "FLEX_DEVICES", ()):
        dense = forward_backward(GPT(cfg, ps, seed=3), batch, autocast)
    assert not calls
    assert torch.isfinite(dense["loss"])
    return flex, dense


# fp32 with TF32 off: both kernels compute the same attention in exact arithmetic, differing
# only in the order of fp32 sums (~1e-7 relative per op); through two layers and backward that
# stays near 1e-6 of each tensor's scale (5e-7 with the CPU's eager FlexAttention), while a
# masking error (one query seeing one key across a document boundary) moves the attention
# projections' gradients by ~70% (measured on the CPU).
FLEX_FP32_TOL = 1e-4
# bf16 autocast: both paths take the same bf16 q, k, v and accumulate in fp32, each rounding
# its outputs to bf16 (2^-9 relative typically), so the second layer's inputs and every
# backward kernel's outputs differ by about an ulp: ~0.1-1% of a tensor's norm (0.8% at most
# on the CPU's kernels). Allowed: 2^-5 (3%), or twice what bf16 itself costs that tensor (the
# dense path's bf16 result against its fp32 one) where that is more; a masking error changes
# the attention gradients by far more than either.
FLEX_BF16_TOL = 2**-5


def relative_norm(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    return float((got - expected).norm() / expected.norm().clamp_min(1e-300))


def check_flex_equals_dense(device: torch.device, name: str) -> None:
    for masked in (True, False):
        flex, fp32 = flex_and_dense(device, name, masked, bf16=False)
        for key, value in fp32.items():
            assert_close_scaled(flex[key], value, FLEX_FP32_TOL, f"fp32, masked={masked}, {key}")
    flex, dense = flex_and_dense(device, name, masked=False, bf16=True)
    for key, value in dense.items():
        tol = max(FLEX_BF16_TOL, 2 * relative_norm(value, fp32[key]))
        assert_relative_norm(flex[key], value, tol, f"bf16 autocast, {key}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_rows_through_compiled_flex_attention_equal_the_dense_mask(name):
    check_flex_equals_dense(CUDA, name)


# ---------------------------------------------------------------------------------------------
# train.compile = eager.

# Inductor fuses the elementwise ops and reduces (norms, the loss's softmax statistics) in
# its own order: fp32 rounding differences of ~1e-7 relative per op, ~1e-6 through the model
# and backward; 1e-4 of each tensor's scale leaves margin, while a wrong graph errs by >1e-2.
COMPILE_TOL = 1e-4


def check_compiled_equals_eager(device: torch.device, name: str,
                                backend: str | None = None) -> None:
    """The model compiled as train.compile does it (model.compile(), in place) against eager,
    one training forward and backward on packed rows (the trainer's: doc ids, no mask, a loss
    scale), fp32. backend: None is the default (inductor), as in training."""
    cfg = flex_config(name)
    ids, _, docs, labels = (t.to(device) for t in packed_batch(cfg.vocab_size, FLEX_SEQ))
    count = (labels != -100).sum()
    results = []
    for compiled in (False, True):
        model = GPT(cfg, ParallelState(device=device), seed=3)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if compiled:
            model.compile(**({} if backend is None else {"backend": backend}))
        out = model(ids, doc_ids=docs, labels=labels, loss_scale=1.0 / count)
        out.loss.backward()
        if compiled:  # dynamo did capture (a no-op compile would pass the comparison)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
        results.append({"loss": out.loss.detach(), "token losses": out.token_losses,
                        "logits": out.logits[..., : cfg.vocab_size].detach(),
                        **{f"grad {n}": p.grad for n, p in model.named_parameters()}})
    eager, compiled = results
    assert eager.keys() == compiled.keys()
    for key, value in eager.items():
        assert_close_scaled(compiled[key], value, COMPILE_TOL, key)


def test_compiled_model_equals_eager():
    # Llama style: RoPE, GQA, SwiGLU, RMSNorm, untied head; FlexAttention inside the graph.
    # One config: compiling is the slow part of these tests.
    check_compiled_equals_eager(CUDA, "llama")


def check_cuda_graphs_equal_eager(device: torch.device, name: str = "llama") -> None:
    """train.compile_mode=reduce-overhead (the compiled step replayed as CUDA graphs) trains as
    eager: STEPS optimizer steps of two different micro-batches each (an input left from the
    previous replay would show), fp32, losses and final weights within COMPILE_TOL."""
    results = []
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        losses, model = train_losses(device, name, "fp32", mode)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        results.append((torch.tensor(losses), weights))
    # Graphs were recorded and replayed (cudagraph trees' manager holds their roots): a mode
    # that fell back to plain kernels would pass the comparison below.
    from torch._inductor.cudagraph_trees import get_manager
    manager = get_manager(device.index or 0, create_if_none_exists=False)
    assert manager is not None and manager.roots, "no CUDA graph was recorded"
    (eager_losses, eager_weights), (graphed_losses, graphed_weights) = results
    assert_close_scaled(graphed_losses, eager_losses, COMPILE_TOL, "losses")
    for key, value in eager_weights.items():
        assert_close_scaled(graphed_weights[key], value, COMPILE_TOL, key)


def test_cuda_graphs_train_as_eager():
    check_cuda_graphs_equal_eager(CUDA)


# ---------------------------------------------------------------------------------------------
# train.precision=pure_bf16 follows bf16 autocast.

def train_losses(device: torch.device, name: str, precision: str,
                 compile_mode: str | None = None) -> tuple[list[float], GPT]:
    """The loss of each of test_pure_bf16's STEPS optimizer steps (2 right-padded micro-batches
    of its batch, lr 1e-2) on `device`, the engine and autocast as train.precision sets them,
    and the trained model; compile_mode: compiled as train.compile_mode says (None: eager)."""
    cfg = pure_bf16_config(name)
    ps = ParallelState(device=device)
    model = GPT(cfg, ps, seed=0)
    if compile_mode is not None:
        model.compile(**compile_settings(TrainConfig(compile=True, compile_mode=compile_mode)))
    engine = NativeEngine(model, TrainConfig(precision=precision), ps)
    autocast = autocast_for(device, precision)
    batches, n_tokens = micro_batches(cfg, ps)
    batches, n_tokens = [b.to(device) for b in batches], n_tokens.to(device)
    losses = []
    for _ in range(STEPS):
        engine.set_lr(1e-2)
        loss, _ = train_step(engine, batches, n_tokens, autocast)
        losses.append(loss.item())
        check_model_is_the_rounded_masters(engine)
    for p in engine.model.parameters():
        assert p.device.type == device.type and engine.master(p).device.type == device.type
        assert p.dtype == (torch.bfloat16 if precision == "pure_bf16" else torch.float32)
    return losses, model


def check_pure_bf16_follows_autocast(device: torch.device, name: str) -> None:
    fp32, autocast, pure = (train_losses(device, name, p)[0] for p in ("fp32", "bf16", "pure_bf16"))
    assert fp32[-1] < fp32[0] and pure[-1] < pure[0]  # it trains
    # test_pure_bf16's tolerance (0.01 on a ~4.6 loss) and reasoning: pure_bf16 rounds the
    # weights and every activation between ops to bf16 where autocast keeps them fp32, ~3e-3
    # over 3 steps; an unscaled or lost gradient, or a skipped update, moves it by > 0.1.
    # The GPU's bf16 kernels (cuBLAS, flash attention) have the same unit roundoff as the CPU's.
    assert_close(torch.tensor(pure), torch.tensor(autocast), atol=LOSS_TOLERANCE, rtol=0)
    assert_close(torch.tensor(pure), torch.tensor(fp32), atol=LOSS_TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pure_bf16_trains_like_autocast(name):
    check_pure_bf16_follows_autocast(CUDA, name)
