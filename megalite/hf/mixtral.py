"""megalite <-> Hugging Face MixtralForCausalLM: Llama's attention and norms, every MLP a mixture
of experts (softmax router, top-k renormalised, no shared experts).

Files hold one tensor per expert, `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up) and `w2`
(down), nn.Linear's [out, in] (what Mistral published and transformers writes; in memory
transformers 5 fuses them), which megalite stacks; the router is `block_sparse_moe.gate`.
"""
from megalite.config import ModelConfig
from megalite.hf import llama
from megalite.hf.experts import MOE, moe_recipe
from megalite.hf.layout import Recipe

NAME = "MixtralForCausalLM"
NEEDS = {**llama.NEEDS, "mlp.kind": "moe", "mlp.router": "softmax", "mlp.renormalize": True}
FREE = llama.FREE | MOE | {"attention.sliding_window"}


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {**llama.config_to_hf(cfg, special, NAME, "mixtral"), "intermediate_size": cfg.expert_ffn,
            "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.mlp.top_k,
            "router_aux_loss_coef": cfg.mlp.aux_loss_coeff, "output_router_logits": False,
            "sliding_window": cfg.attention.sliding_window}


def config_from_hf(hf: dict) -> ModelConfig:
    return llama.config_from_hf(hf, "Mixtral", attention=llama.one_window(hf), mlp={
        "kind": "moe", "experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"],
        "expert_ffn_hidden": hf["intermediate_size"],
        "aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))})


def recipe(cfg: ModelConfig) -> Recipe:
    """Llama's recipe, each MLP replaced by the router and the stacked experts."""
    return moe_recipe(cfg, "block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"})
