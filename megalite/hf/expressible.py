"""Whether a Hugging Face architecture can hold a megalite model config: one rule for every
architecture. Each says which settings it fixes (`needs`) and which it can carry at any value
(`free`); every other setting must be at its default, or the export would silently drop it.
"""
from __future__ import annotations

import dataclasses

from megalite.config import ModelConfig
from megalite.typed_config import ConfigError

# What every architecture carries: the sizes, and what only training reads.
SHARED = frozenset({"architecture", "vocab_size", "vocab_pad_multiple", "max_seq_len", "n_layers",
                    "hidden", "n_heads", "ffn_hidden", "norm_eps", "dropout", "init_std"})
# A decoder of Llama's shape: GQA, rotary (and its scalings), a head of its own or tied.
DECODER = frozenset({"n_kv_heads", "head_dim", "rope_theta", "rope_scaling", "rope_factor",
                     "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len",
                     "rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_mscale",
                     "rope_mscale_all_dim", "tie_embeddings"})
LLAMA_NEEDS = {"position": "rotary", "norm": "rmsnorm", "activation": "swiglu", "bias": False}
# A mixture of experts' settings that training alone reads (capacity, balancing losses).
MOE = frozenset({"n_experts", "moe_top_k", "moe_ffn_hidden", "moe_aux_loss_coeff",
                 "moe_z_loss_coeff", "moe_capacity_factor"})


def check_expressible(cfg: ModelConfig, arch) -> None:
    """A ConfigError "not exportable as NAME: ..." listing each setting the architecture
    module `arch` cannot hold (its NEEDS, FREE and, if it has them, its own problems first)."""
    name, needs = arch.NAME, arch.NEEDS
    wrong = list(getattr(arch, "problems", lambda _: [])(cfg))
    wrong += [f"model.{key}={getattr(cfg, key)!r} ({name} needs {value!r})"
              for key, value in needs.items() if getattr(cfg, key) != value]
    for field in dataclasses.fields(ModelConfig):
        key = field.name
        if key not in needs and key not in arch.FREE and key not in SHARED:
            if getattr(cfg, key) != field.default:
                wrong.append(f"model.{key}={getattr(cfg, key)!r} ({name} has no such setting: "
                             f"{field.default!r})")
    if wrong:
        raise ConfigError(f"not exportable as {name}: " + "; ".join(wrong))


def moe_problems(cfg: ModelConfig) -> list[str]:
    """A mixture-of-experts architecture's (Mixtral, Qwen3-MoE)."""
    return [] if cfg.n_experts else ["model.n_experts=0 (a mixture of experts needs >= 1)"]
