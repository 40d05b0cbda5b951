"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), its heads split across TP ranks.

    q      = W_qup norm(W_qdown x)         (or W_q x without q_lora_rank): per head nope + rope dims
    c, k_r = W_kvdown x                    a latent of kv_lora_rank and ONE rotary key per token
    k_h, v_h = W_kvup_h norm(c)            each head's key (nope dims) and value from the latent
    k_h = [k_h, rope(k_r)], q_h = [q_h_nope, rope(q_h_rope)]; softmax(q k^T / sqrt(nope + rope)) v

What is split how: the down-projections and their norms are replicated (every rank makes the
whole latent from the same x, which enters the TP region once, through f or SP's g); the
up-projections are column-parallel by heads, reading the latent with no further f (its
gradient here is this rank's heads' part, as is that of the replicated weights: summed over TP,
the weights' by their own f, x's by the shared one); the output projection is row-parallel.
Per layer the collectives are GQA's: one all-reduce forward (g), one backward (f).

Context parallel: what moves between CP ranks is the latent and the rotary key,
(kv_lora_rank + qk_rope_head_dim) per token, not per-head keys and values; each rank then
up-projects the whole row's latent for its heads. Generation: the KV cache holds the same,
the latent and the rotated rotary key of each token (KVCache's keys and values).
"""
from functools import partial

import torch

from megalite.config import ModelConfig
from megalite.model.attention import HeadsAttention
from megalite.model.inputs import RankInputs
from megalite.model.mlp import down_init_std
from megalite.model.norm import Norm
from megalite.model.positions import apply_rotary, yarn_scale
from megalite.parallel.layers import ColumnParallelLinear, RowParallelLinear, fused_column_parallel
from megalite.parallel.random import TensorParallelRNG
from megalite.parallel.contexts import ContextParallel, TensorParallel

LATENT_NORM_EPS = 1e-6  # DeepSeek's latent RMSNorms keep their default epsilon, whatever the model's


class LatentAttention(HeadsAttention):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, cp: ContextParallel,
                 rng: TensorParallelRNG, layer: int):
        super().__init__(cfg, tp, cp, rng, layer)
        self.nope, self.rope, self.v_dim = cfg.attention.qk_nope_head_dim, cfg.attention.qk_rope_head_dim, cfg.attention.v_head_dim
        self.rank = cfg.attention.kv_lora_rank
        # YaRN's checkpoints (DeepSeek-V3) also rescale the scores by the mscale_all_dim
        # correction, squared (transformers' yarn_apply_mscale)
        yarn = cfg.positions.scaling
        mscale = (yarn_scale(yarn.factor, yarn.mscale_all_dim)
                  if yarn.kind == "yarn" and yarn.mscale_all_dim else 1.0)
        self.scale = (self.nope + self.rope) ** -0.5 * mscale * mscale
        rank = cfg.attention.q_lora_rank
        column = partial(ColumnParallelLinear, tp=tp, bias=False, init_std=cfg.init_std)
        # shards=1: every TP rank holds the whole matrix, its gradient summed over them.
        self.q_down = column(cfg.hidden, rank, shards=1) if rank else None
        self.q_norm = Norm(cfg, self.split_heads, rank, eps=LATENT_NORM_EPS) if rank else None
        self.q_up = column(rank or cfg.hidden, cfg.n_heads * (self.nope + self.rope))
        self.fused_linears = [("q_down" if rank else "q_up", "kv_down")]
        self.kv_down = column(cfg.hidden, self.rank + self.rope, shards=1)
        self.kv_norm = Norm(cfg, self.split_heads, self.rank, eps=LATENT_NORM_EPS)
        self.kv_up = column(self.rank, cfg.n_heads * (self.nope + self.v_dim))
        if cp.size > 1 and self.kv_up.partial_output_grad is None:
            self.kv_up.partial_output_grad = ("every CP rank reads the whole row's latents, with "
                                              "its own queries' part of the gradient")
        self.out_proj = RowParallelLinear(cfg.n_heads * self.v_dim, cfg.hidden, tp, bias=False,
                                          init_std=down_init_std(cfg))

    def cache_shapes(self, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What a KV cache holds per token: the latent and the rotary key, one of each for all
        heads (GQA: kv_heads x head_dim twice)."""
        return (batch, 1, max_len, self.rank), (batch, 1, max_len, self.rope)

    def forward(self, x: torch.Tensor, inputs: RankInputs) -> torch.Tensor:
        q, latent = fused_column_parallel(x, self.q_down or self.q_up, self.kv_down)
        if self.q_down is not None:
            q = self.q_up.project(self.q_norm(q))  # this rank's heads
        q = q.unflatten(-1, (self.heads, self.nope + self.rope)).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        c, k_rot = latent.split([self.rank, self.rope], dim=-1)
        c, k_rot = self.kv_norm(c).unsqueeze(1), k_rot.unsqueeze(1)  # [b, 1, s, .]
        angles = inputs.rotary["global"]
        q_rot, k_rot = apply_rotary(q_rot, *angles), apply_rotary(k_rot, *angles)
        c, k_rot = self._whole_rows(c, k_rot, inputs.cache, dim=-1)  # the row's latents and rotary keys: small
        kv = self.kv_up.project(c.squeeze(1))
        kv = kv.unflatten(-1, (self.heads, self.nope + self.v_dim)).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.heads, -1, -1)), dim=-1)
        return self._attend(torch.cat((q_nope, q_rot), dim=-1), k, v, inputs.layout)
