"""Activation memory of one transformer layer: the formulas of Korthikanti et al. 2022, and what
this implementation really stores, measured.

The paper (section 4, table 2) counts the bytes one layer keeps for backward, with 16-bit
activations, 1-byte dropout masks, LayerNorm and a 4h GeLU MLP; s sequence, b batch, h hidden,
a heads, t TP size:

    no parallelism                 s b h (34 + 5 a s / h)
    tensor parallel                s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel     s b h / t (34 + 5 a s / h)

The 5 a s / h term is the attention scores, the softmax and its dropout mask. A fused attention
kernel (flash, SDPA's) recomputes them in backward instead of storing them:
attention_scores=False leaves 34, and 10 + 24/t. The 10 of tensor parallelism is what it leaves
replicated (the norms' inputs, the inputs of Q/K/V and of the MLP, the residual dropout masks);
sequence parallelism splits it too.
"""
from __future__ import annotations

import torch

from megalite.model.gpt import GPT


def formula_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                            sequence_parallel: bool = False,
                            attention_scores: bool = True) -> float:
    """The paper's activation bytes per layer and per rank (16-bit activations)."""
    scores = 5 * heads * seq / hidden if attention_scores else 0.0
    per_token_and_hidden = ((34 + scores) / tp if sequence_parallel
                            else 10 + 24 / tp + scores / tp)
    return seq * batch * hidden * per_token_and_hidden


def saved_bytes_per_block(model: GPT, *args, **kwargs) -> list[int]:
    """Bytes that each transformer block saves for backward on this rank during
    model(*args, **kwargs), one number per block.

    Counts the storages of the tensors autograd saves while the block's forward runs, each
    storage once (Q, K and V saved as views of one projection output are one allocation),
    parameters excluded (they are not activations). Run in training mode and without
    activation checkpointing: recomputation stores the block's input only, through hooks of its
    own that hide what the block saves from these.
    """
    if model.activation_checkpointing and model.training:
        raise ValueError("measure a GPT built with activation_checkpointing=False: recomputed "
                         "blocks hide what they save")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[dict[int, int]] = [{} for _ in model.blocks]
    running: list[int | None] = [None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if running[0] is not None and storage.data_ptr() not in params:
            saved[running[0]][storage.data_ptr()] = storage.nbytes()
        return t

    def enter(index: int):
        return lambda module, args: running.__setitem__(0, index)

    hooks = [h for i, block in enumerate(model.blocks)
             for h in (block.register_forward_pre_hook(enter(i)),
                       block.register_forward_hook(lambda module, args, out: running.__setitem__(0, None)))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return [sum(storages.values()) for storages in saved]
