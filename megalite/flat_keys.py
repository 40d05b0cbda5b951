"""The model keys of before the config had sections (b4372df and earlier: `model.n_experts`,
`model.rope_theta`, ...), each with its place now. A checkpoint's meta.json holding them is read
as the sections it means; a config giving them is translated once, with a note naming the new
keys (docs/config.md, "Keys of earlier versions")."""
from __future__ import annotations

import dataclasses
import typing
import warnings

from megalite.config import ModelConfig
from megalite.typed_config import variants

MOVED = {
    **{k: f"attention.{k}" for k in ("n_kv_heads", "head_dim", "qk_norm", "qkv_bias", "query_pre_attn_scalar",
                                     "sliding_window", "sliding_window_pattern", "q_lora_rank",
                                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    "attention": "attention.kind", "position": "positions.kind", "rope_theta": "positions.theta",
    "rope_local_theta": "positions.local_theta", "rope_scaling": "positions.scaling.kind",
    **{f"rope_{k}": f"positions.scaling.{k}" for k in (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len", "beta_fast",
        "beta_slow", "attention_factor", "mscale", "mscale_all_dim")},
    "ffn_hidden": "mlp.ffn_hidden", "activation": "mlp.activation", "n_experts": "mlp.experts",
    "moe_ffn_hidden": "mlp.expert_ffn_hidden", "n_shared_experts": "mlp.shared_experts",
    **{f"moe_{k}": f"mlp.{k}" for k in (
        "top_k", "every", "dense_layers", "router", "renormalize", "groups", "topk_groups",
        "routed_scaling", "aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "capacity_factor",
        "shared_gate")},
    "norm": "norms.kind", "norm_eps": "norms.eps", "norm_weight_offset": "norms.weight_offset",
    "post_norms": "norms.post_norms",
}


def nest(model: dict, note: bool = True) -> dict:
    """`model` (a raw mapping) with its flat keys moved into their sections. note False: a
    checkpoint's whole mapping, whose keys of variants it does not use are dropped (its model
    ignored them: `moe_top_k` of a dense model); note True: a config's, translated with a note."""
    flat = {k: v for k, v in model.items() if k in MOVED and not isinstance(v, dict)}
    if not flat:
        return model
    out = {k: v for k, v in model.items() if k not in flat}
    if "n_experts" in flat:
        flat["mlp.kind"] = "moe" if flat["n_experts"] else "dense"
        if not flat["n_experts"]:
            del flat["n_experts"]
    kinds = {MOVED.get(k, k): v for k, v in flat.items() if MOVED.get(k, k).endswith(".kind")}

    def order(item):  # variants first, outer ones before inner ones
        path = MOVED.get(item[0], item[0])
        return not path.endswith(".kind"), path.count(".")
    written = []
    for key, value in sorted(flat.items(), key=order):
        path = MOVED.get(key, key).split(".")
        fields, fixed = _fields_at(out, path[:-1], kinds)
        # Of a variant not chosen: a checkpoint's (the old model ignored it) is dropped, and a
        # config's at its default where the config itself chose the variant; else it stays,
        # for the preset's or the checkpoint's section to take, or the loader to refuse.
        if path[-1] in fields or not fixed or (note and _plain(value) != _plain(_default_at(path))):
            mapping = out
            for name in path[:-1]:
                mapping = mapping.setdefault(name, {})
            mapping[path[-1]] = value
            written.append(f"model.{key} -> model.{'.'.join(path)}" if key in MOVED else None)
    if note:  # (model.n_experts: its kind too)
        warnings.warn("model keys of before the config had sections, translated: " +
                      ", ".join(w for w in written if w) + ("; model.n_experts -> model.mlp.kind="
                                                           + flat["mlp.kind"] if "mlp.kind" in flat else "")
                      + "; write the new keys (docs/config.md)", stacklevel=3)
    return out


def _fields_at(model: dict, path: list[str], kinds: dict) -> tuple[set[str], bool]:
    """The fields of the section at `path`'s chosen variant (none where the variants chosen
    above have no such section), and whether the mapping chose every variant on the way (or
    left one to its default: a preset or a checkpoint may choose it)."""
    cls, mapping, fixed = ModelConfig, model, True
    for depth, name in enumerate(path):
        mapping = mapping.get(name, {}) if isinstance(mapping, dict) else {}
        hints = typing.get_type_hints(cls) if cls is not None else {}
        if name not in hints:
            cls = None
            continue
        default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
        given = mapping.get("kind", kinds.get(".".join(path[:depth + 1] + ["kind"])))
        fixed = fixed and (given is not None or not variants(hints[name]))
        kind = default.kind if given is None else given
        cls = variants(hints[name]).get(kind) if variants(hints[name]) else hints[name]
    return set() if cls is None else {f.name for f in dataclasses.fields(cls)}, fixed


def _default_at(path: list[str], cls=ModelConfig):
    """The default of the setting at `path` in whichever variants have it (what a flat key's
    default meant)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == path[0])
    if len(path) == 1:
        return field.default
    annotation = typing.get_type_hints(cls)[path[0]]
    for option in (variants(annotation) or {"": annotation}).values():
        if path[1] in {f.name for f in dataclasses.fields(option)}:
            return _default_at(path[1:], option)


def _plain(value):
    """As JSON holds it: tuples are lists."""
    return list(value) if isinstance(value, tuple) else value
