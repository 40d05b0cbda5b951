"""Positions and the attention mask of a batch: plain, right-padded, left-padded or packed.

Computed once per forward and shared by every layer. `mask` is None when causal attention alone
is exact, which lets scaled_dot_product_attention pick its fused kernels (flash on GPU);
otherwise it is a boolean [batch, 1, seq, seq] mask, True where a query may attend a key. Packed
documents on GPU carry the same rule as a FlexAttention BlockMask instead (model/doc_attention.py).
Left-padded rows, prompts and KV-cache decoding keep the dense mask: generation, not training.
"""
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask

from megalite.model.doc_attention import MaskMod, block_mask, dense_mask, uses_flex


@dataclass
class SequenceLayout:
    positions: torch.Tensor  # [batch, seq] position of each token within its sequence/document
    mask: torch.Tensor | None
    block_mask: BlockMask | None = None  # instead of mask: packed documents on GPU
    # [seq] each query's index among the keys (a CP share, tokens after a KV cache's); None:
    # the queries are the keys, 0 .. seq - 1
    queries: torch.Tensor | None = None
    # Rows of packed documents: every micro-batch of a run has the same shape, which FlexAttention
    # compiles for (doc_attention.flex); padded rows and prompts vary in width.
    packed: bool = False
    _windows: dict = field(default_factory=dict, repr=False, compare=False)

    def windowed(self, window: int) -> "SequenceLayout":
        """This layout for a sliding-window layer: a query also sees only the keys less than
        `window` places before it in the row (transformers' sliding_window_overlay; within a
        document or between real tokens, places and positions differ alike). Built once per
        forward and window, shared by the layers; the layout itself where nothing falls out."""
        if window not in self._windows:
            self._windows[window] = self._narrowed(window)
        return self._windows[window]

    def _narrowed(self, window: int) -> "SequenceLayout":
        seq, device = self.positions.shape[1], self.positions.device
        queries = torch.arange(seq, device=device) if self.queries is None else self.queries
        if self.mask is not None:
            keys = self.mask.shape[-1]
        elif self.block_mask is not None:
            keys = self.block_mask.seq_lengths[1]
        elif self.queries is None:
            keys = seq  # plain causal rows: the keys are the queries
        else:
            keys = int(queries[-1]) + 1 if seq else 0  # decoding: every cached token
        if window >= keys:
            return self
        if self.mask is not None:
            near = queries.view(-1, 1) - torch.arange(keys, device=device) < window
            return SequenceLayout(self.positions, self.mask & near, queries=self.queries)
        rule = None if self.block_mask is None else self.block_mask.mask_mod
        batch = 1 if rule is None else self.block_mask.kv_num_blocks.shape[0]  # causal: broadcast

        def near_rule(b, h, q, k):
            sees = k <= queries[q] if rule is None else rule(b, h, q, k)
            return sees & (queries[q] - k < window)
        # Decoding (queries after a cache) keeps a dense mask, as its unwindowed layouts do.
        return _ruled(self.positions, near_rule, batch, seq, device, keys, self.queries, self.packed,
                      flex=self.block_mask is not None or self.queries is None)


def _ruled(positions: torch.Tensor, rule: MaskMod, batch: int, seq: int, device: torch.device,
           keys: int | None = None, queries: torch.Tensor | None = None, packed: bool = False,
           flex: bool = True) -> SequenceLayout:
    """The layout whose mask is `rule` over [batch, seq, keys (default seq)]: a BlockMask where
    FlexAttention runs (unless not `flex`; packed rows' compiled for their one shape), else the
    dense mask."""
    if flex and uses_flex(device):
        rule_mask = block_mask(rule, batch, seq, device, keys, packed)
        return SequenceLayout(positions, None, rule_mask, queries, packed)
    return SequenceLayout(positions, dense_mask(rule, batch, seq, device, keys), queries=queries)


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
        return SequenceLayout(index.expand(batch, seq), None, queries=index)
    return _padded_layout(attention_mask.bool(), start)


def _padded_layout(real: torch.Tensor, start: int) -> SequenceLayout:
    """Tokens start.. of rows padded anywhere (real: [batch, start + n]): positions count from
    each row's first real token."""
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)[:, start:]
    keys = torch.arange(real.shape[1], device=real.device)
    rows = torch.arange(real.shape[0], device=real.device).view(-1, 1, 1)
    return SequenceLayout(positions, _sees(real, rows, keys[start:].unsqueeze(-1), keys).unsqueeze(1),
                          queries=keys[start:])


def _sees(real: torch.Tensor, b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Query q of row b sees the real keys up to itself, and itself: a padding query with nothing
    to attend would give a softmax over an empty row (NaN, which would then poison gradients).
    Elementwise in (b, q, k), so it serves dense masks and FlexAttention's mask_mod alike."""
    return ((k <= q) & real[b, k]) | (k == q)


def sequence_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    doc_ids: torch.Tensor | None = None) -> SequenceLayout:
    """attention_mask: 1 real token, 0 padding. doc_ids: document of each token (packed rows)."""
    (batch, seq), device = input_ids.shape, input_ids.device
    index = torch.arange(seq, device=device)
    if attention_mask is None and doc_ids is None:
        return SequenceLayout(index.expand(batch, seq), None)
    real = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
            else attention_mask.bool())
    if doc_ids is None:
        # Right padding: real tokens form a prefix, so under the causal mask a real query can
        # only see real keys, and the plain causal path is exact at every real position. Pad
        # positions compute values that nothing reads (their labels are -100). Checking for it
        # costs one host sync per forward; callers with right-padded batches can skip it by
        # passing no mask at all.
        if bool((real[:, 1:] <= real[:, :-1]).all()):
            return SequenceLayout(index.expand(batch, seq), None)
        return _padded_layout(real, 0)  # left padding
    # Packed documents: positions restart where the document id changes, and a query sees only
    # earlier keys of its own document. A document also starts at its first real token, should
    # pads before it share its id.
    starts = (doc_ids != doc_ids.roll(1, dims=-1)) | (index == 0) | (real & ~real.roll(1, dims=-1))
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values

    def document_causal(b, h, q, k):  # FlexAttention's mask_mod signature
        return (doc_ids[b, q] == doc_ids[b, k]) & _sees(real, b, q, k)

    return _ruled(index - first, document_causal, batch, seq, device, packed=True)


def _causal(b, h, q, k):
    return k <= q


def context_layout(layout: SequenceLayout, index: torch.Tensor, batch: int, seq: int,
                   dense: bool = False) -> SequenceLayout:
    """The layout of a context-parallel rank's queries, the row's tokens at `index`, against
    the whole row's keys (parallel/context.py): positions taken at index and the mask's rows
    of those queries. Plain causal attention becomes an explicit rule, since the queries are
    no longer a prefix of the keys. `dense`: the rows as a tensor also where FlexAttention runs
    (ring attention cuts its blocks' masks from them), built once here for every layer."""
    positions, device = layout.positions[:, index], index.device
    if layout.mask is not None:
        return SequenceLayout(positions, layout.mask[:, :, index], queries=index)

    rule: MaskMod = _causal if layout.block_mask is None else layout.block_mask.mask_mod

    def rows(b, h, q, k):
        return rule(b, h, index[q], k)
    return _ruled(positions, rows, batch, len(index), device, seq, index, layout.packed, flex=not dense)
