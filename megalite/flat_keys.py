"""The model keys of before the config had sections (b4372df and earlier: `model.n_experts`,
`model.rope_theta`, ...), each with its place now. A checkpoint's meta.json holding them is read
as the sections it means; a config giving them is translated once, with a note naming the new
keys (docs/config.md, "Keys of earlier versions")."""
import typing
import warnings

from megalite.config import ModelConfig
from megalite.typed_config import field_names, set_dotted, variants

MOVED = {
    **{k: f"attention.{k}" for k in (
        "n_kv_heads head_dim qk_norm qkv_bias query_pre_attn_scalar sliding_window sliding_window_pattern "
        "q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim").split()},
    "attention": "attention.kind", "position": "positions.kind", "rope_theta": "positions.theta",
    "rope_local_theta": "positions.local_theta", "rope_scaling": "positions.scaling.kind",
    **{f"rope_{k}": f"positions.scaling.{k}" for k in (
        "factor low_freq_factor high_freq_factor original_max_seq_len beta_fast beta_slow "
        "attention_factor mscale mscale_all_dim").split()},
    "ffn_hidden": "mlp.ffn_hidden", "activation": "mlp.activation", "n_experts": "mlp.experts",
    "moe_ffn_hidden": "mlp.expert_ffn_hidden", "n_shared_experts": "mlp.shared_experts",
    **{f"moe_{k}": f"mlp.{k}" for k in (
        "top_k every dense_layers router renormalize groups topk_groups routed_scaling aux_loss_coeff "
        "z_loss_coeff bias_update_rate capacity_factor shared_gate").split()},
    "norm": "norms.kind", "norm_eps": "norms.eps", "norm_weight_offset": "norms.weight_offset",
    "post_norms": "norms.post_norms",
}


def nest(model: dict, note: bool = True) -> dict:
    """`model` (a raw mapping) with its flat keys moved into their sections. note False: a
    checkpoint's whole mapping, whose keys of variants it does not use are dropped (its model
    ignored them: `moe_top_k` of a dense model); note True: a config's, translated with a note."""
    flat = {MOVED[k]: v for k, v in model.items() if k in MOVED and not isinstance(v, dict)}
    if not flat:
        return model
    out = {k: v for k, v in model.items() if MOVED.get(k) not in flat}
    if "mlp.experts" in flat:
        flat["mlp.kind"] = "moe" if flat["mlp.experts"] else "dense"
        if not flat["mlp.experts"]:
            del flat["mlp.experts"]
    written = []
    # Variants first, outer ones before inner ones: a section's kind is in `out` before its keys.
    for path, value in sorted(flat.items(), key=lambda kv: (not kv[0].endswith(".kind"), kv[0].count("."))):
        keys = path.split(".")
        fields, fixed = _fields_at(out, keys[:-1])
        # Of a variant not chosen: a checkpoint's (the old model ignored it) is dropped, and a
        # config's at its default where the config itself chose the variant; else it stays,
        # for the preset's or the checkpoint's section to take, or the loader to refuse.
        if keys[-1] in fields or not fixed or (note and _plain(value) != _plain(_default_at(keys))):
            set_dotted(out, keys, value)
            written.append(path)
    if note:  # (model.n_experts: its kind too)
        old = {new: old for old, new in MOVED.items()}
        moved = ", ".join(f"model.{old[path]} -> model.{path}" for path in written if path in old)
        kind = f"; model.n_experts -> model.mlp.kind={flat['mlp.kind']}" if "mlp.kind" in flat else ""
        warnings.warn(f"model keys of before the config had sections, translated: {moved}{kind}; "
                      "write the new keys (docs/config.md)", stacklevel=3)
    return out


def _fields_at(model: dict, path: list[str]) -> tuple[set[str], bool]:
    """The fields of the section at `path`'s chosen variant (none where the variants chosen
    above have no such section), and whether the mapping chose every variant on the way (or
    left one to its default: a preset or a checkpoint may choose it)."""
    cls, mapping, fixed = ModelConfig, model, True
    for name in path:
        mapping = mapping.get(name, {}) if isinstance(mapping, dict) else {}
        hints = typing.get_type_hints(cls) if cls is not None else {}
        if name not in hints:  # nothing deeper has fields
            return set(), fixed
        choices, given = variants(hints[name]), mapping.get("kind")
        fixed = fixed and (given is not None or not choices)
        kind = getattr(cls, name).kind if given is None else given  # (a field's default: its class's)
        cls = choices.get(kind) if choices else hints[name]
    return set() if cls is None else field_names(cls), fixed


def _default_at(path: list[str], cls=ModelConfig):
    """The default of the setting at `path` in whichever variants have it (what a flat key's
    default meant)."""
    if len(path) == 1:
        return getattr(cls, path[0])  # the field's default (the model's sections have no factories)
    annotation = typing.get_type_hints(cls)[path[0]]
    for option in (variants(annotation) or {"": annotation}).values():
        if path[1] in field_names(option):
            return _default_at(path[1:], option)


def _plain(value):
    """As JSON holds it: tuples are lists."""
    return list(value) if isinstance(value, tuple) else value
