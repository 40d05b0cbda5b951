"""megalite <-> Hugging Face GPT2LMHeadModel.

GPT-2 keeps its linear weights as Conv1D, [in, out] (the transpose of nn.Linear), and fuses Q, K
and V into one c_attn of [h, 3h] whose output columns are [q | k | v], each head-major.
"""
from megalite.config import Dense, ModelConfig, Norms
from megalite.hf.layout import Recipe, kv_interleaved, padded, whole
from megalite.typed_config import ConfigError, failing

ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


NAME = "GPT2LMHeadModel"
NEEDS = {"attention.kind": "gqa", "positions.kind": "learned", "norms.kind": "layernorm",
         "mlp.kind": "dense", "bias": True, "tie_embeddings": True}
FREE = frozenset({"mlp.activation", "attention.n_kv_heads"})


def problems(cfg: ModelConfig) -> list[str]:
    out = [] if cfg.kv_heads == cfg.n_heads else [
        f"model.attention.n_kv_heads={cfg.kv_heads!r} (GPT-2 needs {cfg.n_heads!r}: no GQA)"]
    if cfg.mlp.activation not in ACTIVATIONS:
        out.append(f"model.mlp.activation={cfg.mlp.activation!r} (GPT-2 needs gelu_tanh or gelu)")
    return out


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {"architectures": [NAME], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_embd": cfg.hidden,
            "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn,
            "activation_function": ACTIVATIONS[cfg.mlp.activation],
            "layer_norm_epsilon": cfg.norms.eps, "initializer_range": cfg.init_std,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "tie_word_embeddings": True, **special}


def config_from_hf(hf: dict) -> ModelConfig:
    # gelu_pytorch_tanh is gelu_new computed by a fused kernel: the same function.
    names = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    activation = names.get(hf.get("activation_function", "gelu_new"))
    problems = failing(
        (activation, f"activation_function {hf.get('activation_function')!r}"),
        (not hf.get("scale_attn_by_inverse_layer_idx"),
         "scale_attn_by_inverse_layer_idx (attention scaled per layer)"),
        (hf.get("scale_attn_weights", True), "scale_attn_weights=false (unscaled attention)"),
        (hf.get("tie_word_embeddings", True), "tie_word_embeddings=false"))
    if problems:
        raise ConfigError("unsupported GPT-2 checkpoint: " + "; ".join(problems))
    return ModelConfig(vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                       n_layers=hf["n_layer"], hidden=hf["n_embd"], n_heads=hf["n_head"],
                       mlp=Dense(ffn_hidden=hf.get("n_inner") or 4 * hf["n_embd"], activation=activation),
                       norms=Norms(eps=hf.get("layer_norm_epsilon", 1e-5)), bias=True,
                       tie_embeddings=True, init_std=hf.get("initializer_range", 0.02))


# megalite module in a block -> GPT-2's (each with a weight and a bias); the c_* are Conv1D, their
# weights stored transposed.
LAYER = {"attn_norm": "ln_1", "attn.out_proj": "attn.c_proj", "mlp_norm": "ln_2", "mlp.up": "mlp.c_fc",
         "mlp.down": "mlp.c_proj"}


def recipe(cfg: ModelConfig) -> Recipe:
    """Each megalite tensor as rows of GPT-2's (see layout.py); c_attn's output columns are
    [q | k | v], each head-major."""
    h, d, kv = cfg.hidden, cfg.head_size, cfg.kv_heads
    t = "transformer."
    out = {"embed.weight": padded(t + "wte.weight", cfg.vocab_size, cfg.padded_vocab),
           "positions.weight": whole(t + "wpe.weight", cfg.max_seq_len)}
    for i in range(cfg.n_layers):
        m, g = f"blocks.{i}.", f"{t}h.{i}."
        for ours, theirs in LAYER.items():
            for kind in ("weight", "bias"):
                out[f"{m}{ours}.{kind}"] = whole(f"{g}{theirs}.{kind}", cfg.ffn if ours == "mlp.up" else h,
                                                 kind == "weight" and ".c_" in theirs)
        for kind in ("weight", "bias"):
            c_attn, conv = g + f"attn.c_attn.{kind}", kind == "weight"
            out[m + f"attn.q_proj.{kind}"] = whole(c_attn, cfg.n_heads * d, conv)
            out[m + f"attn.kv_proj.{kind}"] = kv_interleaved(
                c_attn, c_attn, kv, d, k_start=cfg.n_heads * d, v_start=cfg.n_heads * d + kv * d,
                transposed=conv)
    out.update({"norm.weight": whole(t + "ln_f.weight", h), "norm.bias": whole(t + "ln_f.bias", h)})
    return out


def canonical(stored: str) -> str:
    """A tensor's name in the recipe, given its name in a file: OpenAI's original GPT-2 files
    name them without the "transformer." that transformers' GPT2LMHeadModel writes."""
    return stored if stored.startswith(("transformer.", "lm_head.")) else "transformer." + stored
