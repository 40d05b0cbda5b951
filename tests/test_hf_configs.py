"""Each architecture's config.json both ways, without weights: a megalite config written by
export and read back by import is the same config; transformers' older and shorter config.json
files (keys left to their defaults, no `layer_types`) read as transformers reads them; what a
recipe cannot hold or compute is refused naming it. And the new model settings' rules."""
import dataclasses

import pytest

from megalite.config import ModelConfig, ParallelConfig
from megalite.run_config import load_model_config
from megalite.hf import deepseek_v3, gemma3, mistral, qwen2, qwen3, qwen3_moe
from megalite.hf.convert import ARCHITECTURES, exportable_as
from megalite.plan import check_layout
from megalite.typed_config import ConfigError, from_dict, merged

pytestmark = pytest.mark.unit

SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None}
# The model settings as a config file's `model:` mapping; `changed` puts changes on them,
# section by section (a section whose kind changes starts from the new variant's defaults).
LLAMA = dict(vocab_size=320, max_seq_len=64, n_layers=6, hidden=32, n_heads=4,
             attention=dict(n_kv_heads=2), positions=dict(kind="rotary"),
             mlp=dict(ffn_hidden=48, activation="swiglu"), norms=dict(kind="rmsnorm"), bias=False,
             tie_embeddings=False)


def changed(settings: dict, **changes) -> dict:
    return merged(settings, changes, ModelConfig)


def model(settings: dict, **changes) -> ModelConfig:
    return from_dict(ModelConfig, changed(settings, **changes), "model.")


CONFIGS = {
    "MistralForCausalLM": changed(LLAMA, attention=dict(head_dim=16, sliding_window=8)),
    "Qwen2ForCausalLM": changed(LLAMA, attention=dict(qkv_bias=True, sliding_window=8,
                                                      sliding_window_pattern=3)),
    "Qwen3ForCausalLM": changed(LLAMA, attention=dict(qk_norm=True, head_dim=16), tie_embeddings=True,
                                positions=dict(scaling=dict(kind="yarn", factor=4.0,
                                                            original_max_seq_len=16))),
    "Qwen3MoeForCausalLM": changed(LLAMA, attention=dict(qk_norm=True, sliding_window=8),
                                   mlp=dict(kind="moe", experts=4, top_k=2, expert_ffn_hidden=16,
                                            dense_layers=(1,))),
    "Gemma3ForCausalLM": changed(LLAMA, mlp=dict(activation="geglu_tanh"),
                                 norms=dict(weight_offset=1.0, post_norms=True),
                                 scale_embeddings=True, tie_embeddings=True,
                                 attention=dict(qk_norm=True, query_pre_attn_scalar=24.0,
                                                sliding_window=8, sliding_window_pattern=3),
                                 positions=dict(scaling=dict(kind="linear", factor=8.0))),
    "DeepseekV3ForCausalLM": changed(LLAMA, attention=dict(kind="mla", q_lora_rank=24, kv_lora_rank=16,
                                                           qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                           v_head_dim=12),
                                     mlp=dict(kind="moe", experts=4, top_k=2, expert_ffn_hidden=16,
                                              shared_experts=1, router="sigmoid", groups=2,
                                              routed_scaling=2.5, dense_layers=(0, 1)),
                                     positions=dict(scaling=dict(kind="yarn", factor=4.0,
                                                                 original_max_seq_len=16,
                                                                 mscale=1.0, mscale_all_dim=1.0))),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_an_exported_config_reads_back_as_itself(name):
    cfg = model(CONFIGS[name], architecture=name)
    check_layout(cfg, ParallelConfig(), 1)
    assert exportable_as(cfg)[0] == name
    arch = ARCHITECTURES[name]
    back = dataclasses.replace(arch.config_from_hf(arch.config_to_hf(cfg, SPECIAL)), architecture=name)
    assert back == cfg


def test_presets_read_back_as_themselves():
    for preset in ("gemma3-1b", "qwen3-0.6b", "llama-1b"):
        cfg = load_model_config(preset)
        arch = ARCHITECTURES[exportable_as(cfg)[0]]
        assert dataclasses.replace(arch.config_from_hf(arch.config_to_hf(cfg, SPECIAL)),
                                   architecture=cfg.architecture) == cfg, preset


HF = {"vocab_size": 320, "max_position_embeddings": 64, "hidden_size": 32, "intermediate_size": 48,
      "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_older_config_files_read_as_transformers_reads_them():
    # Gemma 3 before layer_types and per-type rope_parameters: every 6th layer global, the
    # sliding ones at rope_local_base_freq, the defaults of Gemma3TextConfig.
    old = gemma3.config_from_hf({**HF, "sliding_window": 16, "rope_theta": 1e6,
                                 "rope_local_base_freq": 1e4, "head_dim": 16})
    assert (old.attention.sliding_window, old.attention.sliding_window_pattern, old.positions.theta,
            old.positions.local_theta, old.attention.query_pre_attn_scalar,
            old.tie_embeddings) == (16, 6, 1e6, 1e4, 256.0, True)
    assert gemma3.config_from_hf({**HF}).attention.sliding_window == 4096  # Gemma3TextConfig's default
    # Qwen2/3: a window only with use_sliding_window, from max_window_layers on.
    for recipe in (qwen2, qwen3):
        assert recipe.config_from_hf({**HF, "sliding_window": 8}).attention.sliding_window is None
        assert recipe.config_from_hf({**HF, "sliding_window": 8, "use_sliding_window": True,
                                      "max_window_layers": 0}).attention.sliding_window == 8
    # Qwen3-MoE and Mistral: one window on every layer (Qwen3-MoE: with use_sliding_window).
    moe = {**HF, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}
    assert qwen3_moe.config_from_hf({**moe, "sliding_window": 8}).attention.sliding_window is None
    on = qwen3_moe.config_from_hf({**moe, "sliding_window": 8, "use_sliding_window": True})
    assert (on.attention.sliding_window, on.attention.sliding_window_pattern) == (8, 1)
    assert mistral.config_from_hf({**HF, "sliding_window": 8}).attention.sliding_window_pattern == 1


@pytest.mark.parametrize("module,changes,message", [
    (qwen2, {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1},
     r"layer_types \[.full_attention., .sliding_attention., .* \(megalite's full-attention layers"),
    (gemma3, {"tie_word_embeddings": False}, r"tie_word_embeddings=false"),
    (gemma3, {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping 50\.0"),
    (qwen2, {"quantization_config": {"quant_method": "fp8"}}, r"quantization_config \(fp8: .*dequantize"),
])
def test_what_a_recipe_cannot_compute_is_refused_naming_it(module, changes, message):
    with pytest.raises(ConfigError, match=message):
        module.config_from_hf({**HF, **changes})


def test_deepseek_refuses_what_it_does_not_compute():
    ds = {**HF, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
          "v_head_dim": 12, "n_routed_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 16}
    with pytest.raises(ConfigError, match="rope_interleave=false"):
        deepseek_v3.config_from_hf({**ds, "rope_interleave": False})
    with pytest.raises(ConfigError, match="mscale_all_dim with rope_type 'linear'"):
        deepseek_v3.config_from_hf({**ds, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                              "mscale_all_dim": 1.0}})


def test_an_export_that_would_drop_a_setting_is_refused():
    # Qwen3-MoE has one window for every layer: a pattern is not its to hold.
    cfg = model(CONFIGS["Qwen3MoeForCausalLM"], architecture="Qwen3MoeForCausalLM",
                attention=dict(sliding_window_pattern=2))
    with pytest.raises(ConfigError, match=r"model\.attention\.sliding_window_pattern=2 "
                                          r"\(Qwen3MoeForCausalLM has no such setting"):
        exportable_as(cfg)


@pytest.mark.parametrize("changes,message", [
    (dict(bias=True), r"model\.attention\.kind=mla .*: model\.bias=true would do nothing"),
    (dict(attention=dict(q_lora_rank=0)), r"model\.attention\.q_lora_rank=0 must be >= 1, or null"),
    (dict(positions=dict(local_theta=100.0), attention=dict(sliding_window=4)),
     r"model\.positions\.local_theta=100\.0 would do nothing"),
])
def test_settings_latent_attention_would_ignore_are_refused(changes, message):
    cfg = model(CONFIGS["DeepseekV3ForCausalLM"], **changes)
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, ParallelConfig(), 1)


MULTI_HEAD = changed(LLAMA, attention=dict(n_kv_heads=None))


@pytest.mark.parametrize("changes,message", [
    (dict(attention=dict(sliding_window_pattern=6)),
     r"model\.attention\.sliding_window_pattern=6 .* needs model\.attention\.sliding_window"),
    (dict(attention=dict(kind="mla"), cp_comm="p2p"), r"set parallel\.cp_comm=all_gather"),
])
def test_settings_that_would_do_nothing_are_refused(changes, message):
    parallel = ParallelConfig(cp=2, cp_comm=changes.pop("cp_comm")) if "cp_comm" in changes else ParallelConfig()
    cfg = model(MULTI_HEAD, **changes)
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, parallel, parallel.cp)


def test_a_yarn_setting_without_yarn_scaling_is_refused_by_the_loader():
    # YaRN's keys are model.positions.scaling.kind=yarn's own: with another scaling they cannot
    # be written (before the sections, check_layout refused them as doing nothing).
    with pytest.raises(ConfigError, match=r"model\.positions\.scaling\.mscale is a key of "
                                          r"model\.positions\.scaling\.kind=yarn, and "
                                          r"model\.positions\.scaling\.kind=none"):
        model(MULTI_HEAD, positions=dict(scaling=dict(mscale=1.0)))
