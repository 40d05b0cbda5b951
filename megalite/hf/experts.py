"""The mixtures of experts' part of a recipe (hf/layout.py), one rule for Mixtral, Qwen2-MoE,
Qwen3-MoE and DeepSeek-V3: each MoE layer's dense MLP replaced by its router and its experts,
which files hold one tensor each and megalite stacks, and its shared experts where it has them.
megalite's expert bias, which all but DeepSeek-V3 lack, reads as zeros there. And the Qwen
mixtures' config.json keys, both ways."""
import dataclasses

from megalite.config import Dense, ModelConfig
from megalite.hf import llama
from megalite.hf.layout import Recipe, Rows, whole

QWEN = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # megalite's -> the files'
# What every MoE architecture carries (hf/expressible.py): the experts' sizes, and the settings
# that training alone reads (capacity, balancing losses).
MOE = frozenset({"mlp.experts", "mlp.top_k", "mlp.expert_ffn_hidden", "mlp.aux_loss_coeff",
                 "mlp.z_loss_coeff", "mlp.capacity_factor"})


def moe_recipe(cfg: ModelConfig, moe: str = "mlp", names: dict[str, str] = QWEN,
               shared: str = "shared_expert", bias: str | None = None, **dense) -> Recipe:
    """Llama's recipe (`dense`: llama.recipe's layer names and attention) of the model with
    every MLP dense (of the dense layers' width), each MoE layer's MLP then replaced: `moe` is
    the layer's MoE module in the files (Mixtral: block_sparse_moe, Qwen: mlp), its router
    `gate`, its experts `experts.{e}.{names[ours]}.weight`; its shared experts (if the model has
    them) `shared` (Qwen2-MoE's shared_expert, gated by shared_expert_gate; DeepSeek-V3:
    shared_experts), with Qwen's names; the expert bias `bias` (DeepSeek-V3:
    gate.e_score_correction_bias)."""
    mlp = Dense(ffn_hidden=cfg.mlp.ffn_hidden, activation=cfg.mlp.activation)
    out = llama.recipe(dataclasses.replace(cfg, mlp=mlp), **dense)
    for i in filter(cfg.is_moe_layer, range(cfg.n_layers)):
        m, l = f"blocks.{i}.mlp.", f"model.layers.{i}.{moe}."
        for ours, theirs in names.items():
            del out[f"{m}{ours}.weight"]
            out[f"{m}experts.{ours}"] = tuple(Rows(f"{l}experts.{e}.{theirs}.weight", 0, 1, stacked=True)
                                              for e in range(cfg.n_experts))  # one expert a row
        out.update({m + "router.weight": whole(l + "gate.weight", cfg.n_experts),
                    m + "router.expert_bias": (whole(l + bias, cfg.n_experts) if bias
                                               else (Rows(None, 0, cfg.n_experts),))})
        if cfg.mlp.shared_experts:
            for ours, theirs in QWEN.items():
                width = cfg.hidden if ours == "down" else cfg.shared_ffn
                out[f"{m}shared.{ours}.weight"] = whole(f"{l}{shared}.{theirs}.weight", width)
            if cfg.mlp.shared_gate:
                out[m + "shared_gate"] = whole(l + "shared_expert_gate.weight", 1)
    return out


def qwen_moe_to_hf(cfg: ModelConfig) -> dict:
    """config.json's keys of a Qwen mixture of experts (Qwen2-MoE, Qwen3-MoE)."""
    return {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.mlp.top_k,
            "moe_intermediate_size": cfg.expert_ffn, "decoder_sparse_step": cfg.mlp.every,
            "mlp_only_layers": list(cfg.mlp.dense_layers), "norm_topk_prob": cfg.mlp.renormalize,
            "router_aux_loss_coef": cfg.mlp.aux_loss_coeff, "output_router_logits": False}


def qwen_moe_from_hf(hf: dict) -> dict:
    """model.mlp of a Qwen MoE config.json (Qwen2-MoE, Qwen3-MoE)."""
    return {"kind": "moe", "experts": hf.get("num_experts", hf.get("num_local_experts")),
            "top_k": hf["num_experts_per_tok"], "expert_ffn_hidden": hf["moe_intermediate_size"],
            "every": hf.get("decoder_sparse_step", 1),
            "dense_layers": tuple(hf.get("mlp_only_layers") or ()),
            "renormalize": bool(hf.get("norm_topk_prob", False)),
            "aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}
