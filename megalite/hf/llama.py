"""megalite <-> Hugging Face LlamaForCausalLM.

Llama's q/k/v/o and gate/up/down are nn.Linear ([out, in], like megalite's); its rotary
embedding uses the rotate-half convention, as megalite does, so Q and K need no permutation.
"""
from typing import Callable

from megalite.config import ModelConfig
from megalite.hf.layout import Recipe, kv_interleaved, padded, whole
from megalite.typed_config import ConfigError, failing, from_dict, merged

NAME = "LlamaForCausalLM"
# Llama's shape, which the decoders below start from (hf/expressible.py): GQA, rotary (and its
# scalings), a head of its own or tied.
NEEDS = {"attention.kind": "gqa", "positions.kind": "rotary", "norms.kind": "rmsnorm",
         "mlp.kind": "dense", "mlp.activation": "swiglu", "bias": False}
FREE = frozenset({"attention.n_kv_heads", "attention.head_dim", "positions.theta",
                  "positions.scaling", "tie_embeddings"})
# Windows on some layers (Qwen2/3, Gemma 3; hf/expressible.py)
SLIDING = frozenset({"attention.sliding_window", "attention.sliding_window_pattern"})


def config_to_hf(cfg: ModelConfig, special: dict[str, int], name: str = NAME,
                 model_type: str = "llama") -> dict:
    """config.json of a Llama-shaped model, named `name` (the family's class) and `model_type`."""
    return {"architectures": [name], "model_type": model_type,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
            "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size, "hidden_act": "silu",
            "rms_norm_eps": cfg.norms.eps, **rope_to_hf(cfg),
            "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout,
            "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings, **special}


def config_from_hf(hf: dict, family: str = "Llama", problems: list[str] = (), **fields) -> ModelConfig:
    """The ModelConfig of a Llama-shaped config.json (Llama, and Mistral, Qwen2/3 and their
    mixtures of experts, Gemma 3, DeepSeek-V3), with the family's own `fields` (sections as
    mappings, merged into Llama's); a ConfigError naming what megalite cannot compute, `problems`
    first."""
    rope, problems = rope_from_hf(hf, list(problems))
    quantized = hf.get("quantization_config") or {}  # e.g. DeepSeek-V3's released fp8 blocks and their scales
    problems += failing(
        (not (hf.get("attention_bias") or hf.get("mlp_bias")), "attention_bias / mlp_bias"),
        (hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r}"),
        (not quantized, f"quantization_config ({quantized.get('quant_method', '?')}: megalite reads "
                        f"unquantized weights; dequantize to bf16 first)"))
    if problems:
        raise ConfigError(f"unsupported {family} checkpoint: " + "; ".join(problems))
    heads = hf["num_attention_heads"]
    attention = {"n_kv_heads": hf.get("num_key_value_heads", heads)}
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        attention["head_dim"] = hf["head_dim"]
    raw = {"vocab_size": hf["vocab_size"], "max_seq_len": hf["max_position_embeddings"],
           "n_layers": hf["num_hidden_layers"], "hidden": hf["hidden_size"], "n_heads": heads,
           "attention": attention, "positions": {"kind": "rotary", **rope},
           "mlp": {"ffn_hidden": hf["intermediate_size"], "activation": "swiglu"},
           "norms": {"kind": "rmsnorm", "eps": hf.get("rms_norm_eps", 1e-6)}, "bias": False,
           "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
           "init_std": hf.get("initializer_range", 0.02)}
    return from_dict(ModelConfig, merged(raw, fields, ModelConfig), "model.")


def sliding_from_hf(hf: dict, default_types: list[str]) -> tuple[dict, list[str]]:
    """(model.attention's sliding_window and sliding_window_pattern, what megalite cannot compute)
    of a config.json: its `layer_types`, or where it has none the family's `default_types`
    (transformers' rule for its older configs)."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types") or default_types
    sliding = [t == "sliding_attention" for t in types]
    if window is None or not any(sliding):
        return {}, []
    # the first full-attention layer's number (a first layer of full attention fails the check)
    pattern = 1 if all(sliding) else sliding.index(False) + 1
    if sliding != [pattern == 1 or (i + 1) % pattern != 0 for i in range(len(types))]:
        return {}, [f"layer_types {types} (megalite's full-attention layers are every "
                    f"sliding_window_pattern-th, the others sliding)"]
    return {"sliding_window": int(window), "sliding_window_pattern": pattern}, []


def one_window(hf: dict) -> dict:
    """Mistral's, Mixtral's and (with use_sliding_window) Qwen3-MoE's rule (no layer_types):
    sliding_window, if set, on every layer."""
    return {} if hf.get("sliding_window") is None else {"sliding_window": int(hf["sliding_window"])}


def qwen_from_hf(hf: dict, family: str, **attention) -> ModelConfig:
    """The ModelConfig of a Qwen2/3 config.json (`attention`: the family's settings), by Qwen's
    sliding-window rule: no window unless use_sliding_window; then by layer_types, or without
    them on the layers from max_window_layers on."""
    sliding, problems = {}, []
    if hf.get("use_sliding_window"):
        start = hf.get("max_window_layers", 0)
        sliding, problems = sliding_from_hf(hf, ["sliding_attention" if i >= start else "full_attention"
                                                 for i in range(hf["num_hidden_layers"])])
    return config_from_hf(hf, family, problems, attention={**attention, **sliding})


def sliding_to_hf(cfg: ModelConfig) -> dict:
    """config.json's sliding-window keys, `layer_types` included."""
    types = ["full_attention" if cfg.window_of(i) is None else "sliding_attention"
             for i in range(cfg.n_layers)]
    window = cfg.attention.sliding_window
    return {"sliding_window": window, "use_sliding_window": window is not None,
            "max_window_layers": 0, "layer_types": types}


# Hugging Face's rope_type -> model.positions.scaling.kind
SCALINGS = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
# The rope parameters each scaling reads (model.positions.scaling.*), under Hugging Face's name
# where HF_ROPE renames one.
ROPE_KEYS = {"none": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"),
             "yarn": ("factor", "original_max_seq_len")}
HF_ROPE = {"original_max_seq_len": "original_max_position_embeddings"}
# Keys a scaling may leave out (their default is megalite's).
ROPE_OPTIONAL = {"yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")}


def rope_from_hf(hf: dict, problems: list[str], rope: dict | None = None) -> tuple[dict, list[str]]:
    """(model.positions' keys but its kind, what megalite cannot compute, after `problems`) of a
    config.json: transformers 5's rope_parameters (rope_theta inside) or the older rope_scaling
    beside rope_theta; or of `rope`, one layer type's rope_parameters (Gemma 3)."""
    if rope is None:
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out = {"theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type not in SCALINGS:
        supported = ", ".join(repr(t) for t in SCALINGS)
        return out, problems + [f"rope scaling {rope_type!r} (megalite computes rope_type {supported})"]
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        problems.append(f"partial_rotary_factor {partial} (megalite rotates the whole head)")
    kind = SCALINGS[rope_type]
    scaling = out["scaling"] = {"kind": kind}
    # transformers' default: the pretraining context is the model's
    given = {"original_max_position_embeddings": hf["max_position_embeddings"],
             **{k: v for k, v in rope.items() if v is not None}}
    if rope_type == "yarn":  # DeepSeek's may leave the factor to the two contexts' ratio
        given.setdefault("factor", hf["max_position_embeddings"] / given["original_max_position_embeddings"])
        if rope.get("truncate", True) is False:
            problems.append("yarn with truncate=false (megalite rounds the ramp's ends out)")
    for ours in ROPE_KEYS[kind]:
        theirs = HF_ROPE.get(ours, ours)
        if theirs in given:
            scaling[ours] = int(given[theirs]) if ours == "original_max_seq_len" else float(given[theirs])
        else:
            problems.append(f"rope scaling {rope_type!r} without {theirs!r}")
    scaling.update({ours: float(given[ours]) for ours in ROPE_OPTIONAL.get(kind, ()) if ours in given})
    return out, problems


def rope_to_hf(cfg: ModelConfig) -> dict:
    """transformers 5's rope_parameters, and rope_theta and rope_scaling for older readers."""
    ours, theta = cfg.positions.scaling, cfg.positions.theta
    keys = ROPE_KEYS[ours.kind] + ROPE_OPTIONAL.get(ours.kind, ())
    scaling = {"rope_type": next(t for t, kind in SCALINGS.items() if kind == ours.kind),
               **{HF_ROPE.get(mine, mine): getattr(ours, mine) for mine in keys
                  if getattr(ours, mine) is not None}}
    return {"rope_theta": theta, "rope_parameters": {**scaling, "rope_theta": theta},
            "rope_scaling": scaling if keys else None}


LAYER = {"attn_norm.weight": "input_layernorm.weight", "attn.q_proj.weight": "self_attn.q_proj.weight",
         "attn.out_proj.weight": "self_attn.o_proj.weight",
         "mlp_norm.weight": "post_attention_layernorm.weight", "mlp.gate.weight": "mlp.gate_proj.weight",
         "mlp.up.weight": "mlp.up_proj.weight", "mlp.down.weight": "mlp.down_proj.weight"}


def recipe(cfg: ModelConfig, layer_names: dict[str, str] = LAYER,
           attention: Callable[[ModelConfig, str], Recipe] | None = None) -> Recipe:
    """Each megalite tensor as rows of Llama's (see layout.py), and of the families that share
    its names. layer_names: a block's tensors but for K/V and what `attention` (default
    gqa_rows) gives, the attention's tensors of a layer from its Hugging Face prefix."""
    h = cfg.hidden
    rows = {"attn.q_proj.weight": cfg.n_heads * cfg.head_size, "mlp.gate.weight": cfg.ffn,
            "mlp.up.weight": cfg.ffn}
    out = {"embed.weight": padded("model.embed_tokens.weight", cfg.vocab_size, cfg.padded_vocab)}
    for i in range(cfg.n_layers):
        m, l = f"blocks.{i}.", f"model.layers.{i}."
        out.update({m + ours: whole(l + theirs, rows.get(ours, h))
                    for ours, theirs in layer_names.items()})
        out.update({m + "attn." + ours: theirs
                    for ours, theirs in (attention or gqa_rows)(cfg, l + "self_attn.").items()})
    out["norm.weight"] = whole("model.norm.weight", h)
    if not cfg.tie_embeddings:
        out["head.weight"] = padded("lm_head.weight", cfg.vocab_size, cfg.padded_vocab)
    return out


def gqa_rows(cfg: ModelConfig, a: str) -> Recipe:
    """The attention's interleaved K/V (and q, k and v biases: Qwen2; q and k norms: Qwen3,
    Gemma 3) as rows of the layer's `a` (model.layers.{i}.self_attn.) tensors."""
    d, out = cfg.head_size, {}
    out["kv_proj.weight"] = kv_interleaved(a + "k_proj.weight", a + "v_proj.weight", cfg.kv_heads, d)
    if cfg.attention.qkv_bias:
        out["q_proj.bias"] = whole(a + "q_proj.bias", cfg.n_heads * d)
        out["kv_proj.bias"] = kv_interleaved(a + "k_proj.bias", a + "v_proj.bias", cfg.kv_heads, d)
    if cfg.attention.qk_norm:
        out["q_norm.weight"] = whole(a + "q_norm.weight", d)
        out["k_norm.weight"] = whole(a + "k_norm.weight", d)
    return out
