"""Packed documents through FlexAttention (model/doc_attention.py) give the dense-mask model.

- the rule: the dense mask the layout builds is the document-causal rule written out here
  independently, on packed rows with pads sharing a document's id, a fully padded row, no
  attention mask (the trainer's path) and the sequence-parallel padding (document -1);
- exact: the flex path gives the dense path's logits, per-token losses and every gradient, fp32
  to 1e-5, for both test configs (GPT-2 style; Llama style with GQA), with and without an
  attention mask: at TP=1 at an odd length and one past FlexAttention's 128-token block, at
  TP=2 with and without sequence parallelism (the odd length padded to shards). TP=4 adds no
  attention case (one head per rank: no GQA) and would cost ~40 s of eager flex on 2 cores;
- dropout on attention probabilities, which flex_attention lacks, and heads narrower than the 16
  its GPU kernel takes fall back to the dense path bit for bit; right-padded batches stay on SDPA's mask-free causal path.

On CPU torch 2.13's flex_attention refuses backward at its entry, though its eager
implementation (the reference its GPU kernel is tested against) has one: `flex_on_cpu` lifts
that check and runs it eagerly (compiled it would cost ~25 s per process). On a GPU the shipped
path, compiled, is checked against the dense one in tests/test_gpu.py (head dims of 16 and up,
which CUDA's flex kernel needs).
"""
import dataclasses

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from megalite.config import ParallelConfig
from megalite.model import GPT
from megalite.model.layout import sequence_layout
from megalite.parallel.state import ParallelState
from megalite.typed_config import replaced
from tests.support.attention import config, flex_equals_dense, flex_on_cpu, packed_batch, reference_mask
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, padded_batch

# An odd length (sequence parallelism pads it to shards), and one past the 128-token block.
LENGTHS = (13, 130)


@pytest.mark.unit
@pytest.mark.parametrize("seq", LENGTHS)
def test_the_dense_mask_is_the_document_causal_rule(seq):
    ids, mask, docs, _ = packed_batch(100, seq)
    mask[1] = 0  # a fully padded row
    # Sequence parallelism's padding to shards: a pad token with a document (-1) of its own.
    sp = [torch.nn.functional.pad(t, (0, 1), value=v) for t, v in ((ids, 0), (mask, 0), (docs, -1))]
    for ids_, mask_, docs_ in [(ids, mask, docs), (ids, None, docs), sp, (sp[0], None, sp[2])]:
        layout = sequence_layout(ids_, mask_, docs_)
        assert layout.block_mask is None
        assert torch.equal(layout.mask, reference_mask(mask_, docs_))


@pytest.mark.unit
def test_packed_rows_carry_a_block_mask_where_flex_runs_and_right_padding_no_mask():
    ids, mask, docs, _ = packed_batch(100, 13)
    right_ids, right_mask, _ = padded_batch(CONFIGS["gpt2"], "right")
    with flex_on_cpu():
        packed = sequence_layout(ids, mask, docs)
        assert packed.mask is None and packed.block_mask is not None
        assert packed.block_mask.seq_lengths == (13, 13)
        for layout in (sequence_layout(right_ids, right_mask), sequence_layout(right_ids)):
            assert layout.mask is None and layout.block_mask is None


def unmasked(batch: tuple) -> tuple:
    """The batch as the trainer passes packed rows: doc ids, no attention mask."""
    ids, _, docs, labels = batch
    return ids, None, docs, labels


# Each config at each length, with and without an attention mask: eager flex costs ~0.3 s of
# CPU per forward and backward, too much for every combination.
@pytest.mark.unit
@pytest.mark.parametrize("config_name, seq, masked", [
    ("gpt2", 13, True), ("gpt2", 130, False), ("llama", 13, False), ("llama", 130, True)])
def test_flex_equals_dense_single_process(config_name, seq, masked):
    cfg = config(config_name, seq)
    batch = packed_batch(cfg.vocab_size, seq)
    flex_equals_dense(cfg, ParallelState(), batch if masked else unmasked(batch))


@pytest.mark.unit
def test_packed_rows_compile_flex_for_their_shape_and_varying_widths_for_any():
    """Packed rows, one shape a run, compile flex and its block mask dynamic=False (training
    and evaluation alike); a window over right-padded rows, whose width changes with each
    micro-batch's longest row, keeps torch.compile's default (dynamic=None)."""
    cfg = config("llama", 13)
    ids, mask, docs, labels = packed_batch(cfg.vocab_size, 13)
    model = GPT(cfg, ParallelState(), seed=0)
    for grad in (True, False):
        with flex_on_cpu() as used, torch.set_grad_enabled(grad):
            model(ids, attention_mask=mask, doc_ids=docs, labels=labels)
        assert set(used) == {(torch_flex.create_block_mask, False),
                             (torch_flex.flex_attention, False)}, grad
    windowed = GPT(replaced(config("llama", 13), "attention.sliding_window", 4), ParallelState(), seed=0)
    right_ids, right_mask, right_labels = padded_batch(windowed.cfg, "right")
    with flex_on_cpu() as used:
        windowed(right_ids, attention_mask=right_mask, labels=right_labels)
    assert set(used) == {(torch_flex.create_block_mask, None), (torch_flex.flex_attention, None)}


@pytest.mark.unit
def test_attention_dropout_falls_back_to_the_dense_path_exactly():
    cfg = config("llama", 13, dropout=0.2)
    flex_equals_dense(cfg, ParallelState(), packed_batch(cfg.vocab_size, 13), exact=True)


@pytest.mark.unit
def test_heads_narrower_than_flex_takes_fall_back_to_the_dense_path_exactly():
    cfg = config("llama", 13, hidden=32)  # heads of 8: GPU flex_attention refuses them
    flex_equals_dense(cfg, ParallelState(), packed_batch(cfg.vocab_size, 13), exact=True)


def check_flex_equals_dense_at_tp2():
    """Both configs in one launch (each costs seconds): heads split; sequence parallelism, the
    length 13 padded to 14 inside the model (the trainer's unmasked rows: the pad is a real
    token of document -1); attention dropout, each rank dropping with its own generator."""
    for name in sorted(CONFIGS):
        cfg = config(name, 13)
        batch = packed_batch(cfg.vocab_size, 13)
        flex_equals_dense(cfg, ParallelState.from_world(2), batch)
        flex_equals_dense(cfg, ParallelState.from_world(2), unmasked(batch),
                          parallel=ParallelConfig(tp=2, sequence_parallel=True))
        flex_equals_dense(dataclasses.replace(cfg, dropout=0.2), ParallelState.from_world(2),
                          batch, exact=True)


@pytest.mark.exactness
def test_flex_equals_dense_tensor_and_sequence_parallel():
    run_distributed(check_flex_equals_dense_at_tp2, 2)
