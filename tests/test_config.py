"""Strict config loading, and one clear error per invalid layout, raised before any collective."""
import dataclasses

import pytest
import torch.distributed as dist

from megalite.config import Experts, Latent, ModelConfig, ParallelConfig, Rotary
from megalite.run_config import load_model_config
from megalite.plan import check_layout
from megalite.parallel.state import init_parallel
from megalite.run_config import load_config
from megalite.typed_config import ConfigError, replaced
from tests.support.models import with_changes

BASE = ModelConfig(vocab_size=1000, hidden=64, n_heads=8, n_layers=2, max_seq_len=64)


def nested(keys: dict) -> dict:
    """The nested mapping that sets dotted keys: nested({"norms.eps": 0}) == {"norms": {"eps": 0}}."""
    out = {}
    for key, value in keys.items():
        *sections, name = key.split(".")
        inner = out
        for section in sections:
            inner = inner.setdefault(section, {})
        inner[name] = value
    return out


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["tiny", "gpt2-small", "gpt2-medium", "llama-1b"])
def test_presets_load_and_are_valid(preset):
    cfg = load_model_config(preset)
    check_layout(cfg, ParallelConfig(), 1)


@pytest.mark.unit
def test_llama_1b_preset_has_the_expected_shape():
    cfg = load_model_config("llama-1b")
    assert (cfg.kv_heads, cfg.head_size, cfg.padded_vocab) == (8, 64, 128256)
    check_layout(cfg, ParallelConfig(tp=8), 16)


@pytest.mark.unit
def test_unknown_key_names_the_nearest_valid_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.n_head'; did you mean 'model\.n_heads'\?"):
        load_model_config("tiny", n_head=4)


@pytest.mark.unit
@pytest.mark.parametrize("key,value,message", [
    ("n_layers", "2", r"model\.n_layers: expected an integer, got '2'"),
    ("n_layers", True, r"model\.n_layers: expected an integer, got True"),
    ("bias", 1, r"model\.bias: expected true or false, got 1"),
    ("dropout", "high", r"model\.dropout: expected a number, got 'high'"),
    ("norms.kind", "batchnorm", r"model\.norms\.kind: 'batchnorm' is not one of 'layernorm', 'rmsnorm'"),
    ("attention.n_kv_heads", 2.5, r"model\.attention\.n_kv_heads: expected an integer, got 2\.5"),
])
def test_wrong_types_name_the_key_and_value(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_model_config("tiny", **nested({key: value}))


@pytest.mark.unit
def test_the_plan_refuses_a_layout_the_model_cannot_split_exactly():
    # The plan's check (every entry point's, before any process group), no longer the
    # model constructor's as well: one place for the rule.
    with pytest.raises(ConfigError, match=r"parallel\.tp=4 must divide the model.s ffn_hidden \(50\)"):
        check_layout(replaced(BASE, "mlp.ffn_hidden", 50), ParallelConfig(tp=4), 4)


@pytest.mark.unit
def test_yaml_exponents_without_a_dot_are_numbers():
    assert load_model_config("tiny", norms={"eps": "1e-5"}).norms.eps == 1e-5


@pytest.mark.unit
def test_optional_fields_accept_null_and_ints_become_floats():
    cfg = load_model_config("tiny", attention={"n_kv_heads": None}, dropout=0)
    assert cfg.attention.n_kv_heads is None and isinstance(cfg.dropout, float)


@pytest.mark.unit
@pytest.mark.parametrize("keys,message", [
    ({"attention.kv_lora_rank": 16}, r"model\.attention\.kv_lora_rank is a key of model\.attention\.kind=mla, and "
                                        r"model\.attention\.kind=gqa: set model\.attention\.kind=mla, or leave it out$"),
    ({"mlp.top_k": 2}, r"model\.mlp\.top_k is a key of model\.mlp\.kind=moe, and model\.mlp\.kind=dense: "
                          r"set model\.mlp\.kind=moe, or leave it out$"),
    ({"positions.theta": 1e6}, r"model\.positions\.theta is a key of model\.positions\.kind=rotary, and "
                                  r"model\.positions\.kind=learned: set model\.positions\.kind=rotary"),
    ({"positions.kind": "rotary", "positions.scaling.factor": 2.0}, r"model\.positions\.scaling\.factor is a key of "
                                         r"model\.positions\.scaling\.kind=linear or llama3 or yarn, and "
                                         r"model\.positions\.scaling\.kind=none: set model\.positions\.scaling\.kind=linear"),
])
def test_a_key_of_a_variant_not_chosen_is_refused_naming_the_kind_that_has_it(keys, message):
    """tiny: grouped-query attention, learned positions (rotary's scaling: none), a dense MLP.
    A key only a mixture of experts has, on a dense model, cannot be written at all."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model=tiny", *(f"model.{key}={value}" for key, value in keys.items())])
    with pytest.raises(ConfigError, match=message):
        load_model_config("tiny", **nested(keys))


@pytest.mark.unit
def test_flat_keys_of_before_are_translated_with_a_note_naming_the_new_keys():
    with pytest.warns(UserWarning, match=r"model keys of before the config had sections") as notes:
        flat = load_config(None, ["model=tiny", "model.n_experts=4", "model.position=rotary",
                                  "model.moe_top_k=1", "model.norm_eps=1e-6"]).model
    note = "\n".join(str(n.message) for n in notes)
    for old, new in (("n_experts", "mlp.experts"), ("position", "positions.kind"),
                     ("moe_top_k", "mlp.top_k"), ("norm_eps", "norms.eps")):
        assert f"model.{old} -> model.{new}" in note, note
    sectioned = load_config(None, ["model=tiny", "model.mlp.kind=moe", "model.mlp.experts=4",
                                   "model.positions.kind=rotary", "model.mlp.top_k=1",
                                   "model.norms.eps=1e-6"]).model
    assert flat == sectioned
    assert (flat.n_experts, flat.mlp.top_k, flat.rotary, flat.norms.eps) == (4, 1, Rotary(), 1e-6)
    assert flat.mlp.activation == "gelu_tanh"  # tiny's, kept


@pytest.mark.unit
def test_a_preset_sections_kind_overridden_keeps_the_keys_both_variants_have():
    """llama-1b's MLP is dense SwiGLU of 8192; as a mixture of experts it keeps both (the keys
    Experts has too) and takes Experts' defaults for the rest. Its GQA's n_kv_heads=8, a key
    latent attention lacks, is dropped rather than refused."""
    cfg = load_config(None, ["model=llama-1b", "model.mlp.kind=moe", "model.attention.kind=mla"]).model
    assert cfg.mlp == Experts(ffn_hidden=8192, activation="swiglu")
    assert cfg.attention == Latent()
    assert cfg.norms == load_model_config("llama-1b").norms and cfg.positions.theta == 500000.0
    moe = load_config(None, ["model=llama-1b", "model.mlp.kind=moe", "model.mlp.experts=4"]).model
    assert moe.mlp == Experts(ffn_hidden=8192, activation="swiglu", experts=4)
    assert moe.attention.n_kv_heads == 8  # a section not overridden: the preset's


@pytest.mark.unit
def test_missing_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"model config 'gpt5' not found \(presets: gemma3-1b, gpt2-medium, gpt2-small, llama-1b, qwen3-0.6b, tiny\)"):
        load_model_config("gpt5")


@pytest.mark.unit
@pytest.mark.parametrize("changes,tp,world,message", [
    (dict(hidden=60), 1, 1, r"model\.hidden=60 is not divisible by model\.n_heads=8: choose n_heads among \[1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60\]"),
    ({"attention.n_kv_heads": 3}, 1, 1, r"model\.n_heads=8 is not divisible by model\.attention\.n_kv_heads=3: choose n_kv_heads among \[1, 2, 4, 8\]"),
    (dict(hidden=40, n_heads=8, positions=Rotary()), 1, 1, r"rotary positions need an even head dim, got 5"),
    ({}, 2, 3, r"^parallel\.tp=2 must divide the world size 3: use parallel\.tp among \[1\] \(the divisors of the world size 3 that split the model\) or launch a multiple of 2 processes$"),
    ({}, 16, 16, r"^parallel\.tp=16 must divide the model's heads \(8\): use parallel\.tp among \[1, 2, 4, 8\] \(the divisors of the world size 16 that split the model\)$"),
    ({"attention.n_kv_heads": 2}, 8, 8, None),  # kv=2 < tp=8 divides it: valid, copies of KV heads
    ({"n_heads": 12, "attention.n_kv_heads": 6, "hidden": 48}, 4, 4, r"parallel\.tp=4 must divide the model's KV heads \(6\): use parallel\.tp among \[1, 2\] \(the divisors of the world size 4 that split the model\)$"),
    ({"n_heads": 12, "attention.n_kv_heads": 2, "hidden": 48}, 4, 4, None),
    ({"mlp.ffn_hidden": 250}, 4, 4, r"parallel\.tp=4 must divide the model's ffn_hidden \(250\): use parallel\.tp among \[1, 2\] \(the divisors of the world size 4 that split the model\)$"),
    (dict(vocab_pad_multiple=2, vocab_size=1001), 4, 4, r"parallel\.tp=4 must divide the model's padded vocab \(1002\): use parallel\.tp among \[1, 2\] \(the divisors of the world size 4 that split the model\), or a model\.vocab_pad_multiple that is a multiple of 4$"),
    (dict(dropout=1.0), 1, 1, r"model\.dropout=1\.0 must be in \[0, 1\)"),
    (dict(n_layers=0), 1, 1, r"model\.n_layers=0 must be >= 1"),
    (dict(max_seq_len=0), 1, 1, r"model\.max_seq_len=0 must be >= 1"),
    ({"norms.eps": 0.0}, 1, 1, r"model\.norms\.eps=0\.0 must be > 0"),
    (dict(init_std=-1.0), 1, 1, r"model\.init_std=-1\.0 must be > 0"),
    ({}, 0, 1, r"parallel\.tp=0 must be >= 1"),
])
def test_each_layout_error_names_values_and_fix(changes, tp, world, message):
    cfg = with_changes(BASE, changes)
    if message is None:
        check_layout(cfg, ParallelConfig(tp=tp), world)
        return
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, ParallelConfig(tp=tp), world)


@pytest.mark.unit
def test_all_problems_come_in_one_error():
    """Each problem once: a tp that fits neither the world nor the model is one line."""
    cfg = dataclasses.replace(BASE, n_heads=5, hidden=64, dropout=2.0)
    with pytest.raises(ConfigError) as err:
        check_layout(cfg, ParallelConfig(tp=2, cp=2), 3)
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid config:" and len(lines) == 4, lines


@pytest.mark.e2e
def test_the_entry_point_rejects_a_bad_layout_before_any_process_group(monkeypatch):
    from megalite.train import main
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="parallel.tp=2 must divide the world size 3"):
        main(["parallel.tp=2"])
    assert not dist.is_initialized()


@pytest.mark.unit
def test_without_torchrun_init_parallel_is_a_plain_single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ps = init_parallel(ParallelConfig(tp=1))
    assert (ps.tp_size, ps.dp_size, ps.tp_group, ps.dp_group) == (1, 1, None, None)
    assert not dist.is_initialized()


@pytest.mark.unit
@pytest.mark.parametrize("override,read", [
    ("model.rope_theta=10000.0", lambda m: m.positions.theta == 10000.0),  # llama-1b's is 5e5
    ("model.rope_local_theta=null", lambda m: m.positions.local_theta is None),
])
def test_a_flat_key_at_its_default_is_the_presets_section_key(override, read):
    """A config's flat key whose section the config does not choose goes on the preset's
    section, even at its default: it is the setting given, not nothing."""
    preset = "gemma3-1b" if "local" in override else "llama-1b"
    with pytest.warns(UserWarning, match="translated"):
        assert read(load_config(None, [f"model.preset={preset}", override]).model)


@pytest.mark.unit
def test_a_checkpoints_settings_its_model_ignored_are_dropped():
    """b4372df ignored rope_theta with learned positions and rope_factor without scaling: a
    checkpoint holding them reads as the model it trained (not refused)."""
    from megalite.flat_keys import nest
    from megalite.typed_config import from_dict
    old = {"position": "learned", "rope_theta": 5e5, "rope_scaling": "none", "rope_factor": 8.0,
           "n_experts": 0, "moe_top_k": 4, "attention": "gqa", "kv_lora_rank": 64}
    assert from_dict(ModelConfig, nest(old, note=False), "model.") == ModelConfig()


@pytest.mark.unit
@pytest.mark.parametrize("overrides", [["parallel.tp=2"], ["train.micro_batch_size=0"]])
def test_deepspeed_with_a_layout_that_does_not_divide_is_refused_not_a_traceback(overrides):
    from megalite.plan import validate
    cfg = load_config(None, ["model=tiny", "train.engine=deepspeed", "train.global_batch_size=4",
                             "train.micro_batch_size=2", *overrides])
    with pytest.raises(ConfigError, match=r"parallel\.tp=2 must divide|train\.micro_batch_size=0"):
        validate(cfg, 1, installed=False)


@pytest.mark.unit
def test_every_variant_sections_default_is_its_first_variant():
    # typed_config reads a section's mapping without `kind` as its first variant
    import typing

    from megalite.typed_config import variants
    for cls in (ModelConfig, Rotary):
        for f in dataclasses.fields(cls):
            choices = variants(typing.get_type_hints(cls)[f.name])
            assert not choices or next(iter(choices)) == f.default.kind, f.name
