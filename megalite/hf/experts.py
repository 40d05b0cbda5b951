"""The mixtures of experts' part of a recipe (hf/layout.py), one rule for Mixtral, Qwen2-MoE and
Qwen3-MoE: each MoE layer's dense MLP replaced by its router and its experts, which files hold
one tensor each and megalite stacks. megalite's expert bias, which these architectures do not
have, reads as zeros."""
from __future__ import annotations

import dataclasses

from megalite.config import Dense, ModelConfig
from megalite.hf.layout import Recipe, Rows, stacked, whole

QWEN = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # megalite's -> the files'


def dense_of(cfg: ModelConfig) -> ModelConfig:
    """The model with every layer's MLP dense (of the dense layers' width): a recipe's start."""
    return dataclasses.replace(cfg, mlp=Dense(ffn_hidden=cfg.mlp.ffn_hidden, activation=cfg.mlp.activation))


def with_experts(out: Recipe, cfg: ModelConfig, moe: str, names: dict[str, str] = QWEN) -> Recipe:
    """`out` (a dense recipe) with every MoE layer's MLP replaced: `moe` is the layer's MoE
    module in the files (Mixtral: block_sparse_moe, Qwen: mlp), its router `gate`, its experts
    `experts.{e}.{names[ours]}.weight`."""
    for i in range(cfg.n_layers):
        if not cfg.is_moe_layer(i):
            continue
        m, l = f"blocks.{i}.mlp.", f"model.layers.{i}.{moe}."
        for ours, theirs in names.items():
            del out[f"{m}{ours}.weight"]
            out[f"{m}experts.{ours}"] = stacked([f"{l}experts.{e}.{theirs}.weight"
                                                 for e in range(cfg.n_experts)])
        out.update({m + "router.weight": whole(l + "gate.weight", cfg.n_experts),
                    m + "router.expert_bias": (Rows(None, 0, cfg.n_experts),)})
    return out
