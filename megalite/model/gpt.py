"""A decoder-only transformer (GPT-2 / Llama family) with every large matrix split across TP ranks.

    x = embed(ids) [+ positions]                   vocab-parallel embedding, g
    for each block:
        x = x + dropout(attention(norm(x)))        heads split: f ... g
        x = x + dropout(mlp(norm(x)))              A by columns, B by rows: f ... g
    logits_r = f(norm(x)) E_r^T                    this rank's vocab columns, never gathered
    loss = vocab_parallel_cross_entropy(logits_r, labels)

What is split how:
| module                | weight split                | communication              |
|-----------------------|-----------------------------|----------------------------|
| embed                 | vocab rows                  | all-reduce forward         |
| attention.q_proj      | output (heads)              | shares attention's f       |
| attention.kv_proj     | output (KV heads; copies    | shares attention's f;      |
|                       | when n_kv_heads < tp)       | copies' grads summed       |
| attention.out_proj    | input (heads)               | all-reduce forward (g)     |
| mlp.gate, mlp.up      | output (ffn)                | shares the MLP's f         |
| mlp.down              | input (ffn)                 | all-reduce forward (g)     |
| head (or tied embed)  | vocab rows                  | f: all-reduce backward     |
| norms, positions, row-parallel biases | replicated  | none                       |
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalite.config import ModelConfig, check_layout
from megalite.model.attention import Attention
from megalite.model.kv_cache import KVCache
from megalite.model.layout import SequenceLayout, cached_layout, sequence_layout
from megalite.model.mlp import MLP
from megalite.model.norm import Norm
from megalite.model.positions import LearnedPositions, Rotary
from megalite.parallel.init import init_parameters_
from megalite.parallel.layers import ColumnParallelLinear
from megalite.parallel.mappings import all_gather, copy_to_tensor_parallel_region
from megalite.parallel.random import TensorParallelRNG
from megalite.parallel.state import ParallelState
from megalite.parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class Output(NamedTuple):
    logits: torch.Tensor  # [batch, seq, padded_vocab / tp]: this rank's vocab columns
    token_losses: torch.Tensor | None  # [batch, seq], 0 where labels == -100


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, pstate: ParallelState, rng: TensorParallelRNG, layer: int):
        super().__init__()
        self.attn_norm = Norm(cfg, pstate.device)
        self.attn = Attention(cfg, pstate, rng, layer)
        self.mlp_norm = Norm(cfg, pstate.device)
        self.mlp = MLP(cfg, pstate)
        self.dropout = cfg.dropout

    def forward(self, x, layout: SequenceLayout, rotary, cache: KVCache | None = None):
        # Residual dropout acts on replicated activations: the default generator, seeded the
        # same on every TP rank, drops the same elements everywhere.
        x = x + F.dropout(self.attn(self.attn_norm(x), layout, rotary, cache), self.dropout,
                          self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, pstate: ParallelState, seed: int = 0):
        super().__init__()
        check_layout(cfg, pstate.tp_size, pstate.world_size)
        self.cfg, self.pstate = cfg, pstate
        self.rng = TensorParallelRNG(seed, pstate)
        device, std = pstate.device, cfg.init_std
        self.embed = VocabParallelEmbedding(cfg.padded_vocab, cfg.hidden, pstate, init_std=std)
        self.positions = (LearnedPositions(cfg.max_seq_len, cfg.hidden, device, std)
                          if cfg.position == "learned" else None)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, device) if cfg.position == "rotary" else None
        self.blocks = nn.ModuleList(Block(cfg, pstate, self.rng, i) for i in range(cfg.n_layers))
        self.norm = Norm(cfg, device)
        self.head = (None if cfg.tie_embeddings else
                     ColumnParallelLinear(cfg.hidden, cfg.padded_vocab, pstate, bias=False,
                                          init_std=std, copy_input=False))
        # Columns past the real vocabulary get -inf logits: no probability mass, no gradient.
        columns = torch.arange(self.embed.vocab_start, self.embed.vocab_end, device=device)
        padding = columns >= cfg.vocab_size
        self.register_buffer("vocab_padding", padding if bool(padding.any()) else None,
                             persistent=False)
        # Recompute each block's activations in backward instead of storing them.
        self.activation_checkpointing = False
        init_parameters_(self, seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                cache: KVCache | None = None) -> Output:
        """cache: decode incrementally; then attention_mask, if given, covers the cached tokens
        and the new ones (left-padded prompts)."""
        start = 0 if cache is None else cache.offset
        if start + input_ids.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + input_ids.shape[1]} exceeds "
                             f"model.max_seq_len={self.cfg.max_seq_len}: truncate the input or "
                             f"raise max_seq_len")
        if cache is None:
            layout = sequence_layout(input_ids, attention_mask, doc_ids)
        else:
            layout = cached_layout(input_ids, attention_mask, start)
        x = self.embed(input_ids)
        if self.positions is not None:
            x = x + self.positions(layout.positions)
        rotary = self.rotary(layout.positions) if self.rotary is not None else None
        x = F.dropout(x, self.cfg.dropout, self.training)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, layout, rotary, use_reentrant=False,
                               context_fn=self.rng.recompute_contexts)
            else:
                x = block(x, layout, rotary, cache)
        if cache is not None:
            cache.offset += input_ids.shape[1]
        x = copy_to_tensor_parallel_region(self.norm(x), self.pstate.tp_group)
        # Tied or not, the head is the vocab-split matrix E_r applied after f: the tied case has
        # no module of its own, so both use the weight directly.
        head = self.embed if self.head is None else self.head
        logits = F.linear(x, head.weight)
        if self.vocab_padding is not None:
            logits = logits.masked_fill(self.vocab_padding, float("-inf"))
        if labels is None:
            return Output(logits, None)
        return Output(logits, vocab_parallel_cross_entropy(logits, labels, self.embed.vocab_start,
                                                           self.pstate.tp_group))

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype = torch.float32) -> KVCache:
        attention = self.blocks[0].attn
        return KVCache(self.cfg.n_layers, batch, attention.kv_heads, max_len, attention.head_dim,
                       self.pstate.device, dtype)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All vocab columns of `logits` (a collective over TP), the padding stripped."""
        if self.pstate.tp_size > 1:
            logits = all_gather(logits, -1, self.pstate.tp_group)
        return logits[..., : self.cfg.vocab_size]
