"""Causal self-attention with its heads split across TP ranks (Megatron-LM, section 3).

Q and K/V are column-parallel by heads, so each rank attends its own heads with no
communication; the output projection is row-parallel. One all-reduce forward (g, in the output
projection) and one backward (the shared f on the input). Sequence parallel, the input is this
rank's sequence shard and the output too: the SP paper's g gathers the whole sequence for Q
and K/V (attention needs every earlier key), and g-bar reduce-scatters the output back to it.

Grouped-query attention: K/V have n_kv_heads heads, each serving n_heads / n_kv_heads
consecutive query heads. Ranks hold consecutive query heads, so when n_kv_heads >= tp each
rank holds the n_kv_heads / tp K/V heads its queries need; when n_kv_heads < tp, tp /
n_kv_heads consecutive ranks keep a copy of the one K/V head their queries share.

Context parallel (parallel/context.py), each rank holds a zig-zag share of the row's tokens:
their K/V are gathered whole over the CP group for its queries (reduce-scattered backward), or
pass around the CP ring (parallel.cp_comm=p2p, parallel/ring_attention.py).

Per architecture: q/k norms (an RMSNorm over each head's width, before rotary: Qwen3, Gemma 3),
whose replicated weights sum their gradients over TP (each rank normalises its own heads); a
softmax scale of query_pre_attn_scalar ** -0.5 (Gemma 3); a sliding window (Mistral, Gemma 3),
the layout's mask narrowed to the last `window` keys of each query (SequenceLayout.windowed), in
training, CP, packed rows and decoding alike; the window layers' own rotary base (Gemma 3).

Kernels: SDPA, causal with no mask where that is exact (flash on GPU) or with the layout's dense
mask; packed documents on GPU, FlexAttention with the layout's BlockMask (model/doc_attention.py).
"""
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.model.doc_attention import FLEX_MIN_HEAD_DIM, block_mask_as_dense, flex
from megalite.model.inputs import RankInputs
from megalite.model.kv_cache import KVCache
from megalite.model.layout import SequenceLayout
from megalite.model.mlp import down_init_std
from megalite.model.norm import Norm
from megalite.model.positions import apply_rotary
from megalite.parallel.context import gather_from_context_parallel_region
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear, fused_column_parallel
from megalite.parallel.sharding import mark_interleaved
from megalite.parallel.random import TensorParallelRNG
from megalite.parallel.ring_attention import Ring, ring_attention
from megalite.parallel.contexts import ContextParallel, TensorParallel


class HeadsAttention(nn.Module):
    """What both attentions (GQA here, MLA in latent_attention.py) share: this rank's heads, the
    layer's sliding window and the attention itself (SDPA or FlexAttention, or ring attention
    under parallel.cp_comm=p2p), into the row-parallel out_proj of the subclass."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, cp: ContextParallel,
                 rng: TensorParallelRNG, layer: int):
        super().__init__()
        self.layer, self.rng, self.dropout = layer, rng, cfg.dropout
        # This rank's heads. Per-head weights (q/k norms) and MLA's replicated latent norms see
        # only their part (split_heads): their gradients are summed over TP.
        self.heads, self.split_heads = cfg.n_heads // tp.size, tp.split_heads()
        self.window = cfg.window_of(layer)
        self.cp_group, self.ring = cp.group, None

    def _whole_rows(self, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                    dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v after the KV cache's, and context parallel the whole row's: this rank's
        queries see every key (gathered over CP, k and v as one message along `dim`)."""
        if cache is not None:
            k, v = cache.extend(self.layer, k, v)
        if self.ring is None and self.cp_group is not None:
            kv = gather_from_context_parallel_region(torch.cat((k, v), dim=dim), self.cp_group)
            k, v = kv.split([k.shape[dim], v.shape[dim]], dim=dim)
        return k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layout: SequenceLayout) -> torch.Tensor:
        """out_proj(softmax(q k^T x scale) v) over the layout's mask, narrowed to the window: this
        rank's heads ([b, heads, s, d]; k and v may have fewer heads, GQA). scale None: 1 / sqrt(d)."""
        if self.window is not None:
            layout = layout.windowed(self.window)
        dropout, gqa = self.dropout if self.training else 0.0, k.shape[1] != q.shape[1]
        if self.ring is not None:
            y = ring_attention(q, k, v, layout.mask, self.ring, self.scale)
        elif (layout.block_mask is not None and dropout == 0
              and min(q.shape[-1], v.shape[-1]) >= FLEX_MIN_HEAD_DIM):
            y = flex(q, k, v, layout.block_mask, gqa, self.scale, static=layout.packed)
        else:
            # FlexAttention has no dropout and no heads under 16 wide: there packed documents take
            # SDPA and the dense mask, rebuilt by each layer (a slow path anyway; pretraining runs
            # without attention dropout, on heads of 64 or more).
            mask = layout.mask if layout.block_mask is None else block_mask_as_dense(layout.block_mask)
            # A prompt attends causally; a decoded token, alone, attends every cached token.
            causal = mask is None and q.shape[2] > 1
            # Attention probabilities belong to this rank's heads only: dropped with the per-rank
            # generator, so that ranks do not drop the same pattern in different heads.
            with self.rng.fork() if dropout > 0 else nullcontext():
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                   dropout_p=dropout, enable_gqa=gqa, scale=self.scale)
        return self.out_proj(y.transpose(1, 2).flatten(2))


class Attention(HeadsAttention):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, cp: ContextParallel,
                 rng: TensorParallelRNG, layer: int):
        super().__init__(cfg, tp, cp, rng, layer)
        self.head_dim, self.kv_heads = cfg.head_size, max(1, cfg.kv_heads // tp.size)
        self.rope = "local" if self.window is not None and cfg.rotary and cfg.rotary.local_theta is not None else "global"
        # None: SDPA's head_dim ** -0.5
        self.scale = None if cfg.attention.query_pre_attn_scalar is None else cfg.attention.query_pre_attn_scalar ** -0.5
        if cp.ring:  # built inside the model's device (GPT.__init__): its receive buffers' too
            self.ring = Ring(cp.group, torch.get_default_device())
        column = partial(ColumnParallelLinear, cfg.hidden, tp=tp, init_std=cfg.init_std,
                         bias=cfg.bias or cfg.attention.qkv_bias)
        self.q_proj = column(cfg.n_heads * cfg.head_size)
        # Fused K and V, laid out per KV head as [k_0, v_0, k_1, v_1, ...], so that a
        # contiguous split hands each rank whole (k, v) pairs of the heads it needs.
        self.kv_proj = column(2 * cfg.kv_heads * cfg.head_size, shards=min(tp.size, cfg.kv_heads))
        mark_interleaved(self.kv_proj.weight, 2, cfg.head_size)  # K and V: two matrices to Muon
        self.fused_linears = [("q_proj", "kv_proj")]  # one matmul (forward): one precision
        self.out_proj = RowParallelLinear(cfg.n_heads * cfg.head_size, cfg.hidden, tp,
                                          bias=cfg.bias, init_std=down_init_std(cfg))
        self.q_norm = Norm(cfg, self.split_heads, cfg.head_size) if cfg.attention.qk_norm else None
        self.k_norm = Norm(cfg, self.split_heads, cfg.head_size) if cfg.attention.qk_norm else None

    def cache_shapes(self, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What a KV cache holds for this layer: this rank's K/V heads' keys and values."""
        return ((batch, self.kv_heads, max_len, self.head_dim),) * 2

    def forward(self, x: torch.Tensor, inputs: RankInputs) -> torch.Tensor:
        # K and V come as two outputs of the interleaved kv_proj, [batch, seq, kv_heads, head_dim].
        q, k, v = fused_column_parallel(x, self.q_proj, self.kv_proj)
        # [batch, seq, heads, head_dim]: the whole sequence, also when x is a shard of it
        q = q.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if inputs.rotary is not None:
            angles = inputs.rotary[self.rope]
            q, k = apply_rotary(q, *angles), apply_rotary(k, *angles)
        k, v = self._whole_rows(k, v, inputs.cache, dim=1)
        return self._attend(q, k, v, inputs.layout)
