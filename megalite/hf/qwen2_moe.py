"""megalite <-> Hugging Face Qwen2MoeForCausalLM: Llama's layers with biases on q, k and v, and
mixtures of experts with a shared expert (a softmax router, top-k, renormalised when
norm_topk_prob; one shared SwiGLU MLP every token passes, scaled by sigmoid(shared_expert_gate x)).

Files hold one tensor per expert (`mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`), which
megalite stacks; the shared expert's width is megalite's mlp.shared_experts x mlp.expert_ffn_hidden.
"""
from __future__ import annotations

from megalite.config import ModelConfig
from megalite.hf import llama
from megalite.hf.experts import dense_of, with_experts
from megalite.hf.expressible import DECODER, LLAMA_NEEDS, MOE
from megalite.hf.layout import Recipe, whole

NAME = "Qwen2MoeForCausalLM"
NEEDS = {**LLAMA_NEEDS, "mlp.kind": "moe", "attention.qkv_bias": True, "mlp.router": "softmax",
         "mlp.shared_gate": True}
FREE = DECODER | MOE | {"mlp.renormalize", "mlp.every", "mlp.dense_layers", "mlp.shared_experts"}


def problems(cfg: ModelConfig) -> list[str]:
    return [] if cfg.mlp.shared_experts else ["model.mlp.shared_experts must be >= 1 (Qwen2-MoE)"]


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {**llama.config_to_hf(cfg, special), "architectures": [NAME],
            "model_type": "qwen2_moe", "qkv_bias": True, "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.mlp.top_k, "moe_intermediate_size": cfg.expert_ffn,
            "shared_expert_intermediate_size": cfg.shared_ffn, "decoder_sparse_step": cfg.mlp.every,
            "mlp_only_layers": list(cfg.mlp.dense_layers), "norm_topk_prob": cfg.mlp.renormalize,
            "router_aux_loss_coef": cfg.mlp.aux_loss_coeff, "output_router_logits": False,
            "use_sliding_window": False}


def config_from_hf(hf: dict) -> ModelConfig:
    problems = []
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window (megalite's Qwen2-MoE attends to the whole context)")
    shared, width = hf["shared_expert_intermediate_size"], hf["moe_intermediate_size"]
    if shared % width:
        problems.append(f"shared_expert_intermediate_size {shared} is not a multiple of "
                        f"moe_intermediate_size {width}")
    return llama.decoder_from_hf({**hf, "attention_bias": False}, "Qwen2-MoE", problems,
                                 attention={"qkv_bias": bool(hf.get("qkv_bias", True))},
                                 mlp={**moe_from_hf(hf), "shared_experts": shared // width,
                                      "shared_gate": True})


def moe_from_hf(hf: dict) -> dict:
    """model.mlp of a Qwen MoE config.json (Qwen2-MoE, Qwen3-MoE)."""
    return {"kind": "moe", "experts": hf.get("num_experts", hf.get("num_local_experts")),
            "top_k": hf["num_experts_per_tok"], "expert_ffn_hidden": hf["moe_intermediate_size"],
            "every": hf.get("decoder_sparse_step", 1),
            "dense_layers": tuple(hf.get("mlp_only_layers") or ()),
            "renormalize": bool(hf.get("norm_topk_prob", False)),
            "aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}


def recipe(cfg: ModelConfig) -> Recipe:
    """Llama's recipe with q, k and v biases, each MoE layer's MLP replaced by the router, the
    stacked experts and the gated shared expert."""
    out = with_experts(llama.recipe(dense_of(cfg)), cfg, "mlp")
    for i in range(cfg.n_layers):
        if cfg.is_moe_layer(i):
            m, l = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                width = cfg.hidden if ours == "down" else cfg.shared_ffn
                out[f"{m}shared.{ours}.weight"] = whole(f"{l}shared_expert.{theirs}.weight", width)
            out[m + "shared_gate"] = whole(l + "shared_expert_gate.weight", 1)
    return out
