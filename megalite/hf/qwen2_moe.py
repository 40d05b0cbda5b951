"""megalite <-> Hugging Face Qwen2MoeForCausalLM: Llama's layers with biases on q, k and v, and
mixtures of experts with a shared expert (a softmax router, top-k, renormalised when
norm_topk_prob; one shared SwiGLU MLP every token passes, scaled by sigmoid(shared_expert_gate x)).

Files hold one tensor per expert (`mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`), which
megalite stacks; the shared expert's width is megalite's mlp.shared_experts x mlp.expert_ffn_hidden.
"""
from megalite.config import ModelConfig
from megalite.hf import llama
from megalite.hf.experts import MOE, moe_recipe, qwen_moe_from_hf, qwen_moe_to_hf

NAME = "Qwen2MoeForCausalLM"
NEEDS = {**llama.NEEDS, "mlp.kind": "moe", "attention.qkv_bias": True, "mlp.router": "softmax",
         "mlp.shared_gate": True}
FREE = llama.FREE | MOE | {"mlp.renormalize", "mlp.every", "mlp.dense_layers", "mlp.shared_experts"}


def problems(cfg: ModelConfig) -> list[str]:
    return [] if cfg.mlp.shared_experts else ["model.mlp.shared_experts must be >= 1 (Qwen2-MoE)"]


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {**llama.config_to_hf(cfg, special, NAME, "qwen2_moe"), "qkv_bias": True, **qwen_moe_to_hf(cfg),
            "shared_expert_intermediate_size": cfg.shared_ffn, "use_sliding_window": False}


def config_from_hf(hf: dict) -> ModelConfig:
    problems = (["use_sliding_window (megalite's Qwen2-MoE attends to the whole context)"]
                if hf.get("use_sliding_window") else [])
    shared, width = hf["shared_expert_intermediate_size"], hf["moe_intermediate_size"]
    if shared % width:
        problems.append(f"shared_expert_intermediate_size {shared} is not a multiple of "
                        f"moe_intermediate_size {width}")
    return llama.config_from_hf({**hf, "attention_bias": False}, "Qwen2-MoE", problems,
                                attention={"qkv_bias": bool(hf.get("qkv_bias", True))},
                                mlp={**qwen_moe_from_hf(hf), "shared_experts": shared // width,
                                     "shared_gate": True})


# Llama's recipe with q, k and v biases, each MoE layer's MLP replaced by the router, the stacked
# experts and the gated shared expert
recipe = moe_recipe
