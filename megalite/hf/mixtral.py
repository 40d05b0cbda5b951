"""megalite <-> Hugging Face MixtralForCausalLM: Llama's attention and norms, every MLP a mixture
of experts (softmax router, top-k renormalised, no shared experts).

Files hold one tensor per expert, `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) and `w2`
(down), nn.Linear's [out, in] (what Mistral published and transformers writes; in memory
transformers 5 fuses them), which megalite stacks; the router is `block_sparse_moe.gate`.
megalite's expert bias, which Mixtral does not have, imports as zeros.
"""
from __future__ import annotations

import dataclasses

from megalite.config import ModelConfig
from megalite.hf import llama
from megalite.hf.layout import Recipe, Rows, stacked, whole
from megalite.typed_config import ConfigError


def check_exportable(cfg: ModelConfig) -> None:
    llama.check_exportable(dataclasses.replace(cfg, n_experts=0))
    wanted = {"moe_router": "softmax", "moe_renormalize": True, "moe_every": 1,
              "n_shared_experts": 0, "moe_bias_update_rate": 0.0}
    wrong = [f"model.{k}={getattr(cfg, k)!r} (Mixtral needs {v!r})" for k, v in wanted.items()
             if getattr(cfg, k) != v]
    if cfg.n_experts == 0:
        wrong.insert(0, "model.n_experts=0 (Mixtral is a mixture of experts)")
    if wrong:
        raise ConfigError("not exportable as MixtralForCausalLM: " + "; ".join(wrong))


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {**llama.config_to_hf(cfg, special), "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral", "intermediate_size": cfg.expert_ffn,
            "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.moe_top_k,
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff, "output_router_logits": False,
            "sliding_window": None}


def config_from_hf(hf: dict) -> ModelConfig:
    window = hf.get("sliding_window")
    if window is not None and window < hf["max_position_embeddings"]:
        raise ConfigError(f"unsupported Mixtral checkpoint: sliding_window {window} (megalite "
                          f"attends to the whole context)")
    dense = llama.config_from_hf(hf)
    return dataclasses.replace(dense, n_experts=hf["num_local_experts"],
                               moe_top_k=hf["num_experts_per_tok"],
                               moe_ffn_hidden=hf["intermediate_size"],
                               moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))


def recipe(cfg: ModelConfig) -> Recipe:
    """Llama's recipe, each MLP replaced by the router and the stacked experts."""
    out = llama.recipe(dataclasses.replace(cfg, n_experts=0))
    experts = cfg.n_experts
    for i in range(cfg.n_layers):
        m, l = f"blocks.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        for name in ("gate", "up", "down"):
            del out[f"{m}{name}.weight"]
        out.update({m + "router.weight": whole(l + "gate.weight", experts),
                    m + "router.expert_bias": (Rows(None, 0, experts),)})
        for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            out[m + "experts." + ours] = stacked([f"{l}experts.{e}.{theirs}.weight"
                                                  for e in range(experts)])
    return out
