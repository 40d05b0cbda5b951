"""megalite <-> Hugging Face Qwen3MoeForCausalLM: Qwen3's attention (q/k norms, a free head
width), mixtures of experts without a shared expert: a softmax router, top-k renormalised when
norm_topk_prob; layers listed in mlp_only_layers, and those off the decoder_sparse_step, dense
(of intermediate_size). Files hold one tensor per expert, `mlp.experts.{e}.gate_proj` etc."""
from __future__ import annotations

import dataclasses

from megalite.config import ModelConfig
from megalite.hf import llama, qwen2_moe
from megalite.hf.experts import with_experts
from megalite.hf.expressible import DECODER, LLAMA_NEEDS, MOE, moe_problems
from megalite.hf.layout import Recipe

NAME = "Qwen3MoeForCausalLM"
NEEDS = {**LLAMA_NEEDS, "qk_norm": True, "moe_router": "softmax"}
# Qwen3-MoE has no layer_types: one window (use_sliding_window) on every layer
FREE = DECODER | MOE | {"sliding_window", "moe_renormalize", "moe_every", "moe_dense_layers"}
problems = moe_problems


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {**llama.config_to_hf(cfg, special), "architectures": [NAME],
            "model_type": "qwen3_moe", "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.moe_top_k, "moe_intermediate_size": cfg.expert_ffn,
            "decoder_sparse_step": cfg.moe_every, "mlp_only_layers": list(cfg.moe_dense_layers),
            "norm_topk_prob": cfg.moe_renormalize, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
            "output_router_logits": False, "sliding_window": cfg.sliding_window,
            "use_sliding_window": cfg.sliding_window is not None}


def config_from_hf(hf: dict) -> ModelConfig:
    sliding, problems = llama.qwen_window(hf, per_layer=False)
    return llama.decoder_from_hf(hf, "Qwen3-MoE", problems, qk_norm=True,
                                 **qwen2_moe.moe_from_hf(hf), **sliding)


def recipe(cfg: ModelConfig) -> Recipe:
    return with_experts(llama.recipe(dataclasses.replace(cfg, n_experts=0)), cfg, "mlp")
