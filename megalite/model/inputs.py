"""What this rank runs of a batch: the one place that turns rows of token ids (with their
padding mask, document ids and labels) into this rank's tokens, labels, positions and masks.

Context parallel (cp > 1): the rank's zig-zag share of every row (parallel/context.py), its
layout computed on the whole row first. Sequence parallel: the whole rows, padded at the end to
a multiple of tp tokens so they cut into equal shards; causal attention hides the padding from
every real token and the head cuts it off, so it is exact. Decoding with a KV cache: the new
tokens after the cached ones, never split.
"""
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Callable

import torch
import torch.nn.functional as F

from megalite.model.kv_cache import KVCache
from megalite.model.layout import SequenceLayout, cached_layout, context_layout, sequence_layout
from megalite.parallel.context import context_chunks, zigzag_index
from megalite.parallel.contexts import ContextParallel, TensorParallel


@dataclass
class HiddenTokens:
    """This rank's tokens between the TP regions (its CP share, its SP shard), for what counts
    tokens across ranks (the MoE router)."""
    real: torch.Tensor  # [batch, hidden_len] bool: neither masked out nor SP's padding
    key: torch.Tensor  # [batch, hidden_len] int64: the token's place in the batch (row-major)


@dataclass
class RankInputs:
    """The one argument every part of a block takes besides the hidden states."""
    ids: torch.Tensor  # [batch, tokens]: this rank's (its CP share; padded to SP shards)
    labels: torch.Tensor | None  # the same tokens' labels, unpadded
    layout: SequenceLayout
    seq: int  # real tokens per row here: the ids past it pad to SP shards
    sp: bool  # the forward runs on sequence shards (TensorParallel.splitting)
    hidden_tokens: Callable[[], HiddenTokens]  # computed only if a layer asks (MoE)
    cache: KVCache | None = None  # decoding: the keys and values before these tokens
    loss_scale: torch.Tensor | float | None = None  # a training forward's (MoE's balancing losses)
    rotary: dict | None = None  # cos and sin of the tokens' positions (model/positions.Rotary)

    @cached_property
    def tokens(self) -> HiddenTokens:
        return self.hidden_tokens()


class RankSplit:
    """How a rank cuts a batch: its CP share, SP's shards."""

    def __init__(self, tp: TensorParallel, cp: ContextParallel, max_seq_len: int):
        self.tp, self.cp, self.max_seq_len = tp, cp, max_seq_len

    def inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               doc_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
               cache: KVCache | None = None) -> RankInputs:
        """cache: the new tokens follow its cached ones; attention_mask, if given, then covers
        both (left-padded prompts)."""
        shards, cp = self.tp.size, self.cp
        start, seq = (0 if cache is None else cache.offset), input_ids.shape[1]
        if start + seq > self.max_seq_len:
            raise ValueError(f"sequence length {start + seq} exceeds "
                             f"model.max_seq_len={self.max_seq_len}: truncate the input or "
                             f"raise max_seq_len")
        sp = self.splits_sequence(cache)
        whole, index = (input_ids, attention_mask), None  # HiddenTokens cut from the whole rows
        if cp.size > 1:
            self._check_context_cut(seq, cache)
            index = zigzag_index(seq, cp.size, cp.rank, input_ids.device)
            layout = context_layout(sequence_layout(input_ids, attention_mask, doc_ids), index,
                                    input_ids.shape[0], seq, dense=cp.ring)
            input_ids, seq = input_ids[:, index], len(index)
            labels = None if labels is None else labels[:, index]
        else:
            if sp:  # the mask, if any, marks the tokens appended as padding; a document of their own
                input_ids = _pad_to_shards(input_ids, shards, 0)
                attention_mask = _pad_to_shards(attention_mask, shards, 0)
                doc_ids = _pad_to_shards(doc_ids, shards, -1)
            layout = (sequence_layout(input_ids, attention_mask, doc_ids) if cache is None
                      else cached_layout(input_ids, attention_mask, start))
        return RankInputs(input_ids, labels, layout, seq, sp,
                          partial(self._hidden_tokens, *whole, start, index, sp), cache)

    def _hidden_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       start: int, index: torch.Tensor | None, sp: bool) -> HiddenTokens:
        """The tokens of this rank's hidden states, from the whole rows: its CP share (`index`),
        or the rows padded to SP's shards; then its SP shard."""
        (batch, seq), device = input_ids.shape, input_ids.device
        real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                else attention_mask[:, start:].bool())
        # Each token's place in the whole rows (cache included), made for this call's tokens only.
        key = (torch.arange(batch, device=device).unsqueeze(1) * (start + seq)
               + torch.arange(start, start + seq, device=device))
        if index is not None:
            real, key = real[:, index], key[:, index]
        elif sp:
            real = _pad_to_shards(real, self.tp.size, False)
            key = _pad_to_shards(key, self.tp.size, -1)
        if sp:
            real, key = (t.chunk(self.tp.size, dim=1)[self.tp.rank] for t in (real, key))
        return HiddenTokens(real, key)

    def splits_sequence(self, cache: KVCache | None) -> bool:
        """Sequence parallel, but not when decoding, which appends a token or a few to the
        cache (nothing to split)."""
        return self.tp.sequence_parallel and cache is None

    def hidden_len(self, seq: int, cache: KVCache | None = None) -> int:
        """The sequence length of this rank's hidden states for rows of `seq` tokens: its
        context-parallel share, then its sequence-parallel shard (padded to shards)."""
        if self.cp.size > 1:
            # Also on later pipeline stages, which size their receives by it: every stage
            # refuses a length the first stage cannot cut, instead of waiting for its message.
            self._check_context_cut(seq, cache)
        seq //= self.cp.size
        return -(-seq // self.tp.size) if self.splits_sequence(cache) else seq

    def _check_context_cut(self, seq: int, cache: KVCache | None) -> None:
        cp = self.cp.size
        if cache is not None:
            raise ValueError(f"parallel.cp={cp}: decoding with a KV cache runs without context "
                             f"parallelism; generate from the checkpoint at parallel.cp=1")
        chunks = context_chunks(cp, self.tp.size, self.tp.sequence_parallel)
        if seq % chunks:
            raise ValueError(f"a sequence of {seq} tokens does not cut into {chunks} equal chunks "
                             f"(2 x parallel.cp{' x parallel.tp' if self.tp.sequence_parallel else ''}): "
                             f"use a length that is a multiple of {chunks}")


def _pad_to_shards(t: torch.Tensor | None, tp: int, value) -> torch.Tensor | None:
    """t with `value` appended along the sequence until its length is a multiple of tp (t
    itself where it is one already: no copy on every forward)."""
    extra = -t.shape[1] % tp if t is not None else 0
    return t if extra == 0 else F.pad(t, (0, extra), value=value)
