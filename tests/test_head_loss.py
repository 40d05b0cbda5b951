"""The fused, chunked LM head + loss equals the unfused path it replaced: the full logits of the
single-process model through F.cross_entropy. Loss, per-token losses and every gradient, fp32,
TP 1/2/4 (and 2 with sequence parallelism), tied and untied heads, a padded vocabulary, ignored
labels, chunks that do and do not divide the tokens, soft-capped logits; both the training path (loss_scale:
gradients made in forward) and per-token losses (any weights, logits recomputed in backward).
And the training path keeps nothing of the logits' size for backward."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from megalite.config import ParallelConfig
from megalite.model import GPT
from megalite.parallel.sharding import shard_of
from megalite.parallel.state import ParallelState
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, gather_full, padded_batch

TOL = dict(atol=1e-5, rtol=1e-5)


def unfused(model: GPT, ids, mask, labels, weights):
    """Today's path before the fusion: whole logits, F.cross_entropy, autograd."""
    out = model(ids, attention_mask=mask)
    logits = out.logits[..., : model.cfg.vocab_size].float()
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    (losses * weights).sum().backward()
    return losses.detach()


def grads(model: GPT, ps: ParallelState) -> dict:
    return {n: gather_full(p.grad, shard_of(p), ps) for n, p in model.named_parameters()}


def check_head_loss(config_name: str, tp: int, sequence_parallel: bool = False, **changes):
    cfg = dataclasses.replace(CONFIGS[config_name], **changes)
    ps = ParallelState.from_world(tp) if tp > 1 else ParallelState()
    layout = ParallelConfig(tp=tp, sequence_parallel=sequence_parallel)
    ids, mask, labels = padded_batch(cfg, "right")
    count = (labels != -100).sum()
    uniform = torch.full(labels.shape, 1.0 / count)
    ref = GPT(cfg, ParallelState(), seed=1)
    ref_losses = unfused(ref, ids, mask, labels, uniform)
    ref_grads = grads(ref, ParallelState())
    other = torch.rand(labels.shape, generator=torch.Generator().manual_seed(2))
    ref.zero_grad()
    unfused(ref, ids, mask, labels, other)
    ref_other_grads = grads(ref, ParallelState())

    tokens = ids.numel()
    for chunk in (7, 10 * tokens):  # uneven chunks; one chunk larger than the batch
        model = GPT(cfg, ps, seed=1, loss_chunk_tokens=chunk, parallel=layout)
        out = model(ids, attention_mask=mask, labels=labels, loss_scale=1.0 / count)
        out.loss.backward()
        assert not out.token_losses.requires_grad
        assert_close(out.token_losses, ref_losses, **TOL)
        assert_close(out.loss, (ref_losses / count).sum(), **TOL)
        for name, grad in grads(model, ps).items():
            assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"chunk {chunk}, {name}: {m}")

        # Per-token losses, weighted however the caller likes.
        model.zero_grad()
        losses = model(ids, attention_mask=mask, labels=labels).token_losses
        (losses * other).sum().backward()
        assert_close(losses.detach(), ref_losses, **TOL)
        for name, grad in grads(model, ps).items():
            assert_close(grad, ref_other_grads[name], **TOL,
                         msg=lambda m: f"chunk {chunk}, per-token, {name}: {m}")


# gpt2: tied head, LayerNorm; llama: untied head, GQA (at TP=4 with KV copies).
@pytest.mark.exactness
@pytest.mark.parametrize("config_name,tp", [("gpt2", 1), ("llama", 1), ("gpt2", 2), ("llama", 4)])
def test_fused_head_loss_equals_the_unfused_path(config_name, tp):
    if tp == 1:
        check_head_loss(config_name, 1)
    else:
        run_distributed(check_head_loss, tp, config_name, tp)


@pytest.mark.exactness
def test_fused_head_loss_with_sequence_parallelism():
    run_distributed(check_head_loss, 2, "gpt2", 2, True)


@pytest.mark.exactness
def test_soft_capped_logits_train_as_the_unfused_path():
    """Gemma 2's final_logit_softcapping, capped low enough to bend the logits: the unfused
    path differentiates cap x tanh(z / cap) by autograd, the fused one by its slope."""
    check_capped(1)
    run_distributed(check_capped, 2, 2)


def check_capped(tp: int):
    check_head_loss("llama", tp, tp > 1, final_logit_softcap=0.5)


@pytest.mark.unit
def test_training_path_saves_nothing_of_the_logits_size():
    # A vocabulary wide enough that the logits are larger than any other activation or weight.
    cfg = dataclasses.replace(CONFIGS["gpt2"], vocab_size=1000)
    model = GPT(cfg, ParallelState(), seed=0)
    ids, mask, labels = padded_batch(cfg, "right")
    logits_numel = ids.numel() * cfg.padded_vocab
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=labels, loss_scale=0.5).loss.backward()
    assert saved and max(saved) < logits_numel
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=labels).token_losses.sum().backward()
    assert saved and max(saved) < logits_numel
