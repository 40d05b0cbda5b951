"""megalite <-> Hugging Face Qwen3MoeForCausalLM: Qwen3's attention (q/k norms, a free head
width), mixtures of experts without a shared expert: a softmax router, top-k renormalised when
norm_topk_prob; layers listed in mlp_only_layers, and those off the decoder_sparse_step, dense
(of intermediate_size). Files hold one tensor per expert, `mlp.experts.{e}.gate_proj` etc."""
from megalite.config import ModelConfig
from megalite.hf import llama
from megalite.hf.experts import MOE, moe_recipe, qwen_moe_from_hf, qwen_moe_to_hf

NAME = "Qwen3MoeForCausalLM"
NEEDS = {**llama.NEEDS, "mlp.kind": "moe", "attention.qk_norm": True, "mlp.router": "softmax"}
# Qwen3-MoE has no layer_types: one window (use_sliding_window) on every layer
FREE = llama.FREE | MOE | {"attention.sliding_window", "mlp.renormalize", "mlp.every", "mlp.dense_layers"}


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    window = cfg.attention.sliding_window
    return {**llama.config_to_hf(cfg, special, NAME, "qwen3_moe"), **qwen_moe_to_hf(cfg),
            "sliding_window": window, "use_sliding_window": window is not None}


def config_from_hf(hf: dict) -> ModelConfig:
    sliding = llama.one_window(hf) if hf.get("use_sliding_window") else {}
    return llama.config_from_hf(hf, "Qwen3-MoE", attention={"qk_norm": True, **sliding},
                                mlp=qwen_moe_from_hf(hf))


recipe = moe_recipe  # Llama's, each MoE layer's MLP its router and stacked experts (mlp.experts.{e})
