"""Sliding-window attention (SequenceLayout.windowed) is the rule written out here on every kind
of layout a forward builds: plain rows, left padding, packed documents, a context-parallel
rank's queries and decoding after a KV cache; a window at least as long as the keys leaves the
layout as it is (the fast paths stay); FlexAttention's block mask of a window (GPU) gives the
dense mask's model, logits and gradients, on plain and packed rows."""
import dataclasses

import pytest
import torch

from megalite.model.layout import cached_layout, context_layout, sequence_layout
from megalite.parallel.context import zigzag_index
from megalite.parallel.state import ParallelState
from tests.support.attention import flex_equals_dense, flex_on_cpu, packed_batch, reference_mask
from tests.support.models import CONFIGS

pytestmark = pytest.mark.unit

WINDOW = 4


def near(queries: torch.Tensor, keys: int) -> torch.Tensor:
    """[queries, keys]: key k is less than WINDOW places before (or after) query q."""
    return (queries.view(-1, 1) - torch.arange(keys)) < WINDOW


def test_the_window_narrows_every_layout_by_places_in_the_row():
    ids, mask, docs, _ = packed_batch(100, 13)
    seq = ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    plain = sequence_layout(ids).windowed(WINDOW)
    assert torch.equal(plain.mask, (causal & near(torch.arange(seq), seq)).expand(1, 1, seq, seq))
    packed = sequence_layout(ids, mask, docs)
    assert torch.equal(packed.windowed(WINDOW).mask, packed.mask & near(torch.arange(seq), seq))
    left = torch.ones_like(mask)
    left[0, :5] = 0  # left padding: a dense mask of its own
    assert torch.equal(sequence_layout(ids, left).windowed(WINDOW).mask,
                       sequence_layout(ids, left).mask & near(torch.arange(seq), seq))
    # A CP rank's queries (the zig-zag share) against the whole row's keys.
    whole = sequence_layout(ids[:, :12], mask[:, :12], docs[:, :12])
    index = zigzag_index(12, 2, 1, ids.device)
    shard = context_layout(whole, index, 4, 12).windowed(WINDOW)
    assert torch.equal(shard.mask, whole.mask[:, :, index] & near(index, 12))
    # Decoding: one token after 9 cached, with and without a padding mask.
    step = cached_layout(ids[:, 9:10], None, 9).windowed(WINDOW)
    assert torch.equal(step.mask, near(torch.tensor([9]), 10).expand(1, 1, 1, 10))
    padded = cached_layout(ids[:, 9:10], mask[:, :10], 9)
    assert torch.equal(padded.windowed(WINDOW).mask, padded.mask & near(torch.tensor([9]), 10))


def test_a_window_longer_than_the_keys_keeps_the_layout():
    ids, mask, docs, _ = packed_batch(100, 13)
    for layout in (sequence_layout(ids), sequence_layout(ids, mask, docs)):
        assert layout.windowed(13) is layout and layout.windowed(WINDOW) is layout.windowed(WINDOW)
    assert sequence_layout(ids).windowed(13).mask is None  # causal SDPA, no mask


@pytest.mark.parametrize("packed", [False, True])
def test_flex_block_mask_of_a_window_equals_the_dense_mask(packed):
    llama = CONFIGS["llama"]
    attention = dataclasses.replace(llama.attention, sliding_window=WINDOW, sliding_window_pattern=2,
                                    qk_norm=True, query_pre_attn_scalar=20.0)
    cfg = dataclasses.replace(llama, hidden=64, max_seq_len=32, attention=attention)
    ids, mask, docs, labels = packed_batch(cfg.vocab_size, 13)
    batch = (ids, None, docs if packed else None, labels)
    with flex_on_cpu():  # the window's block mask holds the rule
        layout = sequence_layout(ids, None, docs if packed else None).windowed(WINDOW)
        grid = (torch.arange(4).view(-1, 1, 1), 0, torch.arange(13).view(1, -1, 1),
                torch.arange(13).view(1, 1, -1))
        rule = layout.block_mask.mask_mod(*grid).unsqueeze(1).expand(4, 1, 13, 13)
    base = reference_mask(None, docs) if packed else torch.ones(13, 13, dtype=torch.bool).tril()
    assert torch.equal(rule, (base & near(torch.arange(13), 13)).expand(4, 1, 13, 13))
    flex_equals_dense(cfg, ParallelState(), batch)
