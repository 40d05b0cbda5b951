"""megalite <-> Hugging Face GPT2LMHeadModel.

GPT-2 keeps its linear weights as Conv1D, [in, out] (the transpose of nn.Linear), and fuses Q, K
and V into one c_attn of [h, 3h] whose output columns are [q | k | v], each head-major.
"""
from __future__ import annotations

import torch

from megalite.config import ModelConfig
from megalite.hf.layout import fuse_kv, pad_rows, split_kv
from megalite.typed_config import ConfigError

ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


def check_exportable(cfg: ModelConfig) -> None:
    wanted = {"position": "learned", "norm": "layernorm", "bias": True, "tie_embeddings": True,
              "kv_heads": cfg.n_heads}
    wrong = [f"model.{k}={getattr(cfg, k)!r} (GPT-2 needs {v!r})" for k, v in wanted.items()
             if getattr(cfg, k) != v]
    if cfg.activation not in ACTIVATIONS:
        wrong.append(f"model.activation={cfg.activation!r} (GPT-2 needs gelu_tanh or gelu)")
    if wrong:
        raise ConfigError("not exportable as GPT2LMHeadModel: " + "; ".join(wrong))


def config_to_hf(cfg: ModelConfig, special: dict[str, int]) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_embd": cfg.hidden,
            "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn,
            "activation_function": ACTIVATIONS[cfg.activation],
            "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "tie_word_embeddings": True, **special}


def config_from_hf(hf: dict) -> ModelConfig:
    # gelu_pytorch_tanh is gelu_new computed by a fused kernel: the same function.
    names = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    activation = names.get(hf.get("activation_function", "gelu_new"))
    problems = [] if activation else [f"activation_function {hf['activation_function']!r}"]
    if hf.get("scale_attn_by_inverse_layer_idx"):
        problems.append("scale_attn_by_inverse_layer_idx (attention scaled per layer)")
    if not hf.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=false (unscaled attention)")
    if not hf.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings=false")
    if problems:
        raise ConfigError("unsupported GPT-2 checkpoint: " + "; ".join(problems))
    return ModelConfig(vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                       n_layers=hf["n_layer"], hidden=hf["n_embd"], n_heads=hf["n_head"],
                       ffn_hidden=hf.get("n_inner") or 4 * hf["n_embd"], activation=activation,
                       norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                       position="learned", bias=True, tie_embeddings=True,
                       init_std=hf.get("initializer_range", 0.02))


# megalite name in a block -> (GPT-2 name in a block, stored transposed as Conv1D).
LAYER = {"attn_norm.weight": ("ln_1.weight", False), "attn_norm.bias": ("ln_1.bias", False),
         "attn.out_proj.weight": ("attn.c_proj.weight", True),
         "attn.out_proj.bias": ("attn.c_proj.bias", False),
         "mlp_norm.weight": ("ln_2.weight", False), "mlp_norm.bias": ("ln_2.bias", False),
         "mlp.up.weight": ("mlp.c_fc.weight", True), "mlp.up.bias": ("mlp.c_fc.bias", False),
         "mlp.down.weight": ("mlp.c_proj.weight", True), "mlp.down.bias": ("mlp.c_proj.bias", False)}


def weights_to_hf(w: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"transformer.wte.weight": w["embed.weight"][: cfg.vocab_size],
           "transformer.wpe.weight": w["positions.weight"],
           "transformer.ln_f.weight": w["norm.weight"], "transformer.ln_f.bias": w["norm.bias"]}
    for i in range(cfg.n_layers):
        m, h = f"blocks.{i}.", f"transformer.h.{i}."
        out.update({h + theirs: w[m + ours].T if transposed else w[m + ours]
                    for ours, (theirs, transposed) in LAYER.items()})
        for kind in ("weight", "bias"):
            k, v = split_kv(w[m + f"attn.kv_proj.{kind}"], cfg.kv_heads)
            fused = torch.cat([w[m + f"attn.q_proj.{kind}"], k, v])
            out[h + f"attn.c_attn.{kind}"] = fused.T if kind == "weight" else fused
    return out


def weights_from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
    out = {"embed.weight": pad_rows(hf["wte.weight"], cfg.padded_vocab),
           "positions.weight": hf["wpe.weight"],
           "norm.weight": hf["ln_f.weight"], "norm.bias": hf["ln_f.bias"]}
    for i in range(cfg.n_layers):
        m, h = f"blocks.{i}.", f"h.{i}."
        out.update({m + ours: hf[h + theirs].T if transposed else hf[h + theirs]
                    for ours, (theirs, transposed) in LAYER.items()})
        for kind in ("weight", "bias"):
            fused = hf[h + f"attn.c_attn.{kind}"]
            q, k, v = (fused.T if kind == "weight" else fused).chunk(3)
            out[m + f"attn.q_proj.{kind}"] = q
            out[m + f"attn.kv_proj.{kind}"] = fuse_kv(k, v, cfg.kv_heads)
    return out
