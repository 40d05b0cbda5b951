"""megalite <-> Hugging Face Gemma3ForCausalLM (Gemma 3, text): embeddings times sqrt(hidden),
RMSNorms scaling by (1 + weight), four of them a layer (before and after attention and MLP),
q/k norms, GeGLU with tanh GeLU, scores scaled by query_pre_attn_scalar ** -0.5, sliding-window
layers (`layer_types`, 5 of 6 by default) with a rotary base of their own, a tied head."""
from megalite.config import ModelConfig
from megalite.hf import llama
from megalite.hf.layout import Recipe

NAME = "Gemma3ForCausalLM"
NEEDS = {**llama.NEEDS, "mlp.activation": "geglu_tanh", "norms.weight_offset": 1.0,
         "norms.post_norms": True, "scale_embeddings": True, "attention.qk_norm": True,
         "tie_embeddings": True}
FREE = (llama.FREE - {"tie_embeddings"}) | llama.SLIDING | {"attention.query_pre_attn_scalar",
                                                         "positions.local_theta", "final_logit_softcap"}
# Llama's names, the norm before the MLP renamed, and the norms after attention and MLP
LAYER = {**llama.LAYER, "mlp_norm.weight": "pre_feedforward_layernorm.weight",
         "attn_post_norm.weight": "post_attention_layernorm.weight",
         "mlp_post_norm.weight": "post_feedforward_layernorm.weight"}


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    scalar = cfg.attention.query_pre_attn_scalar or cfg.head_size
    # transformers' config class takes query_pre_attn_scalar as an int (every release's is)
    out = {**llama.config_to_hf(cfg, special, NAME, "gemma3_text"),
           "hidden_activation": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
           "final_logit_softcapping": cfg.final_logit_softcap, "attn_logit_softcapping": None,
           "use_bidirectional_attention": False, **llama.sliding_to_hf(cfg)}
    del out["hidden_act"], out["mlp_bias"], out["rope_theta"], out["rope_scaling"]
    full, theta = out["rope_parameters"], cfg.positions.local_theta
    local = {"rope_type": "default", "rope_theta": theta} if theta else full
    out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return out


# Gemma3TextConfig's defaults, for config.json files that leave a key out
DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True}


def config_from_hf(hf: dict) -> ModelConfig:
    hf = {**DEFAULTS, **hf}
    # transformers' rule without layer_types: every sliding_window_pattern-th layer global
    # (DEFAULTS give every config.json a sliding_window_pattern)
    sliding, problems = llama.sliding_from_hf(hf, [
        "full_attention" if (i + 1) % hf["sliding_window_pattern"] == 0 else "sliding_attention"
        for i in range(hf["num_hidden_layers"])])
    if not hf["tie_word_embeddings"]:
        problems.append("tie_word_embeddings=false (Gemma 3's head is its embedding)")
    if hf.get("attn_logit_softcapping") is not None:
        problems.append(f"attn_logit_softcapping {hf['attn_logit_softcapping']} (megalite's "
                        f"attention kernels do not soft-cap scores)")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention (megalite's attention is causal)")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new"):
        problems.append(f"hidden_activation {hf['hidden_activation']!r}")
    # transformers 5: rope_parameters per layer type; before: rope_theta, rope_scaling and
    # rope_local_base_freq
    ropes = hf.get("rope_parameters") or {}
    full = ropes.get("full_attention", ropes or hf.get("rope_scaling") or {})
    local = (ropes.get("sliding_attention")
             or {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]})
    rope, problems = llama.rope_from_hf(hf, problems, full)
    # Sliding layers turning as the global ones (an export's, without a base of their own):
    # no local base.
    if local != full and "sliding_window" in sliding:
        local_rope, problems = llama.rope_from_hf(hf, problems, local)
        if local_rope["scaling"]["kind"] != "none":
            problems.append(f"rope scaling {local.get('rope_type')!r} on the sliding-window layers")
        rope["local_theta"] = local_rope["theta"]
    return llama.config_from_hf(
        {**hf, "hidden_act": "silu", "rope_parameters": {}, "rope_scaling": None}, "Gemma 3",
        problems, positions={"kind": "rotary", **rope}, mlp={"activation": "geglu_tanh"},
        norms={"weight_offset": 1.0, "post_norms": True}, scale_embeddings=True,
        attention={**sliding, "qk_norm": True, "query_pre_attn_scalar": float(hf["query_pre_attn_scalar"])},
        final_logit_softcap=hf.get("final_logit_softcapping"))


def recipe(cfg: ModelConfig) -> Recipe:
    return llama.recipe(cfg, LAYER)
