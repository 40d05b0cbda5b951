"""megalite <-> Hugging Face Qwen2MoeForCausalLM: Llama's layers with biases on q, k and v, and
mixtures of experts with a shared expert (a softmax router, top-k, renormalised when
norm_topk_prob; one shared SwiGLU MLP every token passes, scaled by sigmoid(shared_expert_gate x)).

Files hold one tensor per expert (`mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`), which
megalite stacks; the shared expert's width is megalite's n_shared_experts x moe_ffn_hidden.
"""
from __future__ import annotations

import dataclasses

from megalite.config import ModelConfig
from megalite.hf import llama
from megalite.hf.layout import Recipe, Rows, kv_interleaved, stacked, whole
from megalite.typed_config import ConfigError


def check_exportable(cfg: ModelConfig) -> None:
    llama.check_exportable(dataclasses.replace(cfg, n_experts=0, qkv_bias=False))
    wanted = {"qkv_bias": True, "moe_router": "softmax", "moe_shared_gate": True,
              "moe_bias_update_rate": 0.0}
    wrong = [f"model.{k}={getattr(cfg, k)!r} (Qwen2-MoE needs {v!r})" for k, v in wanted.items()
             if getattr(cfg, k) != v]
    if cfg.n_experts == 0 or cfg.n_shared_experts == 0:
        wrong.insert(0, "model.n_experts and model.n_shared_experts must be >= 1 (Qwen2-MoE)")
    if wrong:
        raise ConfigError("not exportable as Qwen2MoeForCausalLM: " + "; ".join(wrong))


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {**llama.config_to_hf(cfg, special), "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe", "qkv_bias": True, "num_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.moe_top_k, "moe_intermediate_size": cfg.expert_ffn,
            "shared_expert_intermediate_size": cfg.shared_ffn, "decoder_sparse_step": cfg.moe_every,
            "mlp_only_layers": [], "norm_topk_prob": cfg.moe_renormalize,
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff, "output_router_logits": False,
            "use_sliding_window": False}


def config_from_hf(hf: dict) -> ModelConfig:
    problems = []
    if hf.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers {hf['mlp_only_layers']} (megalite's dense layers are "
                        f"every decoder_sparse_step-th's others)")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window (megalite attends to the whole context)")
    shared, width = hf["shared_expert_intermediate_size"], hf["moe_intermediate_size"]
    if shared % width:
        problems.append(f"shared_expert_intermediate_size {shared} is not a multiple of "
                        f"moe_intermediate_size {width}")
    if problems:
        raise ConfigError("unsupported Qwen2-MoE checkpoint: " + "; ".join(problems))
    dense = llama.config_from_hf({**hf, "attention_bias": False})
    return dataclasses.replace(dense, qkv_bias=bool(hf.get("qkv_bias", True)),
                               n_experts=hf["num_experts"], moe_top_k=hf["num_experts_per_tok"],
                               moe_ffn_hidden=width, moe_every=hf.get("decoder_sparse_step", 1),
                               moe_renormalize=bool(hf.get("norm_topk_prob", False)),
                               n_shared_experts=shared // width, moe_shared_gate=True,
                               moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))


def recipe(cfg: ModelConfig) -> Recipe:
    """Llama's recipe with q, k and v biases, each MoE layer's MLP replaced by the router, the
    stacked experts and the gated shared expert."""
    out = llama.recipe(dataclasses.replace(cfg, n_experts=0))
    experts = cfg.n_experts
    for i in range(cfg.n_layers):
        m, l = f"blocks.{i}.", f"model.layers.{i}."
        a = l + "self_attn."
        out[m + "attn.q_proj.bias"] = whole(a + "q_proj.bias", cfg.n_heads * cfg.head_dim)
        out[m + "attn.kv_proj.bias"] = kv_interleaved(a + "k_proj.bias", a + "v_proj.bias",
                                                      cfg.kv_heads, cfg.head_dim)
        if not cfg.is_moe_layer(i):
            continue
        m, l = m + "mlp.", l + "mlp."
        for name in ("gate", "up", "down"):
            del out[f"{m}{name}.weight"]
            width = cfg.hidden if name == "down" else cfg.shared_ffn
            out[f"{m}shared.{name}.weight"] = whole(f"{l}shared_expert.{name}_proj.weight", width)
            out[f"{m}experts.{name}"] = stacked([f"{l}experts.{e}.{name}_proj.weight"
                                                 for e in range(experts)])
        out.update({m + "router.weight": whole(l + "gate.weight", experts),
                    m + "router.expert_bias": (Rows(None, 0, experts),),
                    m + "shared_gate": whole(l + "shared_expert_gate.weight", 1)})
    return out
