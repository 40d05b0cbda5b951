"""Packed documents and FlexAttention on CPU: flex_on_cpu lifts torch's CPU refusal of its
backward and runs it eagerly; packed rows whose documents cross rows, the document-causal mask
written out independently, and the check that the flex path gives the dense path's logits,
losses and gradients."""
import dataclasses
import warnings
from contextlib import contextmanager, nullcontext
from unittest import mock

import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.testing import assert_close

from megalite.model import GPT, doc_attention
from megalite.parallel.state import ParallelState
from tests.support.models import CONFIGS, PAD_ID


TOL = dict(atol=1e-5, rtol=1e-5)


@contextmanager
def flex_on_cpu():
    """Layouts and attention take the flex path on CPU; yields the functions it compiled (run
    eagerly here) with torch.compile's `dynamic` for each, to show that it ran."""
    used = []
    with mock.patch.object(doc_attention, "FLEX_DEVICES", ("cuda", "cpu")), \
            mock.patch.object(doc_attention, "compiled",
                              lambda fn, dynamic=None: used.append((fn, dynamic)) or fn), \
            mock.patch.object(torch_flex, "_validate_device", lambda *tensors: None), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        yield used


def config(name: str, seq: int, **overrides):
    """A test config with heads FlexAttention takes (16 wide: hidden 64 over 4 heads)."""
    # A multiple of 32: sequence parallelism needs one of tp.
    return dataclasses.replace(CONFIGS[name], max_seq_len=32 * -(-seq // 32),
                               **{"hidden": 64, **overrides})


def packed_batch(vocab_size: int, seq: int, seed: int = 0) -> tuple:
    """ids, attention mask, doc ids, labels of 4 packed rows: documents cut at random places
    (so they cross rows); row 2 ends in pads that share its last document's id, row 3 starts
    with pads sharing its first document's id and ends in pads of their own."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (4, seq), generator=generator)
    starts = torch.rand(4, seq, generator=generator) < 0.25
    starts[:, 0] = True
    docs = starts.long().cumsum(-1)
    mask = torch.ones(4, seq, dtype=torch.long)
    mask[2, -3:] = 0
    docs[2, -3:] = docs[2, -4]
    mask[3, :2] = 0
    docs[3, :3] = docs[3, 2]
    mask[3, -4:] = 0
    docs[3, -4:] = docs[3, -5] + 1
    ids[mask == 0] = PAD_ID
    follows = (docs[:, 1:] == docs[:, :-1]) & mask[:, 1:].bool() & mask[:, :-1].bool()
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:].masked_fill(~follows, -100)
    return ids, mask, docs, labels


def reference_mask(mask: torch.Tensor | None, docs: torch.Tensor) -> torch.Tensor:
    """Query q sees key k when k is a real token of q's document at or before q; every query
    sees itself (else a pad query's softmax row would be empty: NaN)."""
    seq = docs.shape[1]
    real = torch.ones_like(docs, dtype=torch.bool) if mask is None else mask.bool()
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    same_doc = docs[:, :, None] == docs[:, None, :]
    return ((causal & same_doc & real[:, None, :]) | torch.eye(seq, dtype=torch.bool)).unsqueeze(1)


def run(model: GPT, batch: tuple) -> tuple:
    """Logits, per-token losses and gradients of one forward and backward."""
    ids, mask, docs, labels = batch
    out = model(ids, attention_mask=mask, doc_ids=docs, labels=labels)
    out.token_losses.sum().backward()
    return out.logits.detach(), out.token_losses.detach(), {
        name: p.grad for name, p in model.named_parameters()}


def flex_equals_dense(cfg, ps: ParallelState, batch: tuple, exact: bool = False, seed: int = 3,
                      parallel=None):
    """`exact`: bit for bit, for the dropout fallback, which runs the dense path itself."""
    results = []
    for flex in (False, True):
        with flex_on_cpu() if flex else nullcontext() as used:
            torch.manual_seed(seed)  # dropout: the same masks both times
            results.append(run(GPT(cfg, ps, seed=seed, parallel=parallel), batch))
        if flex:
            assert any(fn is torch_flex.flex_attention for fn, _ in used) == (not exact)
    (logits, losses, grads), (flex_logits, flex_losses, flex_grads) = results
    assert torch.isfinite(logits).any(-1).all()
    tol = dict(atol=0, rtol=0) if exact else TOL
    assert_close(flex_logits, logits, **tol)
    assert_close(flex_losses, losses, **tol)
    for name, grad in grads.items():
        assert_close(flex_grads[name], grad, **tol, msg=lambda m: f"{name}: {m}")
