"""Positions and the attention mask of a batch: plain, right-padded, left-padded or packed.

Computed once per forward and shared by every layer. `mask` is None when causal attention alone
is exact, which lets scaled_dot_product_attention pick its fused kernels (flash on GPU);
otherwise it is a boolean [batch, 1, seq, seq] mask, True where a query may attend a key.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceLayout:
    positions: torch.Tensor  # [batch, seq] position of each token within its sequence/document
    mask: torch.Tensor | None


def cached_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  start: int) -> SequenceLayout:
    """The layout of tokens start .. start + n of sequences whose first `start` tokens are in a
    KV cache. attention_mask (or None: no padding) covers all start + n tokens."""
    batch, seq = input_ids.shape
    if attention_mask is None:
        index = torch.arange(start, start + seq, device=input_ids.device)
        # Causal within the new tokens is what SDPA's is_causal does only when nothing is cached.
        if start and seq > 1:
            raise ValueError("several new tokens after a cached prefix need an attention_mask")
        return SequenceLayout(index.expand(batch, seq), None)
    real = attention_mask.bool()
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)[:, start:]
    queries = torch.arange(start, start + seq, device=input_ids.device)
    keys = torch.arange(start + seq, device=input_ids.device)
    allowed = (keys <= queries.unsqueeze(-1)) & real.unsqueeze(1)
    allowed = allowed | (keys == queries.unsqueeze(-1))  # a pad query attends itself: no NaN
    return SequenceLayout(positions, allowed.unsqueeze(1))


def sequence_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    doc_ids: torch.Tensor | None = None) -> SequenceLayout:
    """attention_mask: 1 real token, 0 padding. doc_ids: document of each token (packed rows)."""
    batch, seq = input_ids.shape
    index = torch.arange(seq, device=input_ids.device)
    if attention_mask is None and doc_ids is None:
        return SequenceLayout(index.expand(batch, seq), None)
    real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
            else attention_mask.bool())
    causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
    if doc_ids is None:
        # Right padding: real tokens form a prefix, so under the causal mask a real query can
        # only see real keys, and the plain causal path is exact at every real position. Pad
        # positions compute values that nothing reads (their labels are -100). Checking for it
        # costs one host sync per forward; callers with right-padded batches can skip it by
        # passing no mask at all.
        if bool((real[:, 1:] <= real[:, :-1]).all()):
            return SequenceLayout(index.expand(batch, seq), None)
        # Left padding: positions count from each sequence's first real token.
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        allowed = causal & real.unsqueeze(1)
    else:
        # Packed documents: positions restart where the document id changes, and a query
        # sees only earlier keys of its own document.
        # A document also starts at its first real token, should pads before it share its id.
        starts = (doc_ids != doc_ids.roll(1, dims=-1)) | (index == 0) | (real & ~real.roll(1, dims=-1))
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
        positions = index - first
        same_doc = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
        allowed = causal & same_doc & real.unsqueeze(1)
    # A padding query with nothing to attend would give a softmax over an empty row (NaN,
    # which would then poison gradients); let it attend itself.
    allowed = allowed | torch.eye(seq, dtype=torch.bool, device=input_ids.device)
    return SequenceLayout(positions, allowed.unsqueeze(1))
