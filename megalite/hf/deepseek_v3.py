"""megalite <-> Hugging Face DeepseekV3ForCausalLM (DeepSeek-V3, Kimi K2's shape): multi-head
latent attention (model/latent_attention.py) and, after the first first_k_dense_replace dense
layers, mixtures of experts with shared experts, sigmoid scores with e_score_correction_bias
(megalite's expert bias), group-limited top-k and routed_scaling_factor.

Layouts: megalite's q_up and kv_down are q_b_proj (or q_proj) and kv_a_proj_with_mqa, whose
rotary rows transformers lays out in interleaved pairs (rope_interleave): megalite holds each
rotary block's even rows, then its odd ones, so that its rotate-half rotation is the same
rotation (q and k permuted alike: the same scores). Files hold one tensor per expert. The
multi-token-prediction layers (num_nextn_predict_layers) are not read: transformers does not
run them either; export writes none.
"""
from megalite.config import ModelConfig
from megalite.hf import llama
from megalite.hf.experts import MOE, moe_recipe
from megalite.hf.layout import Recipe, Rows, whole

NAME = "DeepseekV3ForCausalLM"
# model.attention's MLA sizes, config.json's keys of the same names
MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
NEEDS = {**llama.NEEDS, "attention.kind": "mla", "mlp.kind": "moe", "mlp.router": "sigmoid"}
FREE = ((llama.FREE - {"attention.n_kv_heads", "attention.head_dim"}) | MOE
        | {f"attention.{k}" for k in MLA}
        | {f"mlp.{k}" for k in ("dense_layers", "groups", "topk_groups", "routed_scaling",
                                "renormalize", "shared_experts", "bias_update_rate")})


def problems(cfg: ModelConfig) -> list[str]:
    dense = cfg.mlp.dense_layers
    return [] if dense == tuple(range(len(dense))) else [
        f"model.mlp.dense_layers={list(dense)} (DeepSeek-V3's dense layers are the first "
        f"first_k_dense_replace: 0, 1, ...)"]


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    a, m = cfg.attention, cfg.mlp
    out = {**llama.config_to_hf(cfg, special, NAME, "deepseek_v3"), **{k: getattr(a, k) for k in MLA},
           "head_dim": a.qk_rope_head_dim, "num_key_value_heads": cfg.n_heads, "rope_interleave": True,
           "n_routed_experts": cfg.n_experts, "num_experts_per_tok": m.top_k,
           "moe_intermediate_size": cfg.expert_ffn, "n_shared_experts": m.shared_experts,
           "n_group": m.groups, "topk_group": m.topk_groups,
           "norm_topk_prob": m.renormalize, "routed_scaling_factor": m.routed_scaling,
           "first_k_dense_replace": len(m.dense_layers), "num_nextn_predict_layers": 0}
    del out["mlp_bias"]
    return out


def config_from_hf(hf: dict) -> ModelConfig:
    problems = [] if hf.get("rope_interleave", True) else [
        "rope_interleave=false (megalite reads DeepSeek's interleaved rotary rows)"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("mscale_all_dim") and rope.get("rope_type", rope.get("type")) not in ("yarn", "default", None):
        problems.append(f"mscale_all_dim with rope_type {rope.get('rope_type')!r} (megalite "
                        f"rescales MLA's scores by it under yarn only)")
    dense = min(hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"])
    return llama.config_from_hf(
        {**hf, "head_dim": None}, "DeepSeek-V3", problems,
        attention={"kind": "mla", "q_lora_rank": hf.get("q_lora_rank"), **{k: hf[k] for k in MLA[1:]}},
        mlp={"kind": "moe", "experts": hf.get("n_routed_experts", hf.get("num_local_experts")),
             "top_k": hf["num_experts_per_tok"], "expert_ffn_hidden": hf["moe_intermediate_size"],
             "shared_experts": hf.get("n_shared_experts") or 0, "router": "sigmoid",
             "groups": hf.get("n_group") or 1, "topk_groups": hf.get("topk_group") or 1,
             "renormalize": bool(hf.get("norm_topk_prob", True)),
             "routed_scaling": float(hf.get("routed_scaling_factor", 1.0)),
             "dense_layers": tuple(range(dense))})


def _rotary_rows(name: str, start: int, width: int) -> tuple[Rows, ...]:
    """A rotary block of `width` rows at `start`: its even rows, then its odd ones."""
    return tuple(Rows(name, start + r, start + r + 1)
                 for r in [*range(0, width, 2), *range(1, width, 2)])


def mla_rows(cfg: ModelConfig, a: str) -> Recipe:
    mla = cfg.attention
    nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
    q = a + ("q_proj.weight" if mla.q_lora_rank is None else "q_b_proj.weight")
    q_up = tuple(part for h in range(cfg.n_heads) for part in (
        (Rows(q, h * (nope + rope), h * (nope + rope) + nope),) if nope else ())
        + _rotary_rows(q, h * (nope + rope) + nope, rope))
    out = {"q_up.weight": q_up,
           "kv_down.weight": (Rows(a + "kv_a_proj_with_mqa.weight", 0, rank),)
           + _rotary_rows(a + "kv_a_proj_with_mqa.weight", rank, rope),
           "kv_norm.weight": whole(a + "kv_a_layernorm.weight", rank),
           "kv_up.weight": whole(a + "kv_b_proj.weight", cfg.n_heads * (nope + mla.v_head_dim))}
    if mla.q_lora_rank is not None:
        out.update({"q_down.weight": whole(a + "q_a_proj.weight", mla.q_lora_rank),
                    "q_norm.weight": whole(a + "q_a_layernorm.weight", mla.q_lora_rank)})
    return out


LAYER = {name: hf for name, hf in llama.LAYER.items() if name != "attn.q_proj.weight"}


def recipe(cfg: ModelConfig) -> Recipe:
    return moe_recipe(cfg, shared="shared_experts", bias="gate.e_score_correction_bias",
                      layer_names=LAYER, attention=mla_rows)
