"""Strict config loading, and one clear error per invalid layout, raised before any collective."""
import dataclasses

import pytest
import torch.distributed as dist

from megalite.config import ModelConfig, ParallelConfig, load_model_config
from megalite.layout_rules import check_layout
from megalite.model import GPT
from megalite.parallel.state import ParallelState, init_parallel
from megalite.typed_config import ConfigError

BASE = ModelConfig(vocab_size=1000, hidden=64, n_heads=8, n_layers=2, max_seq_len=64)


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
    ("norm", "batchnorm", r"model\.norm: 'batchnorm' is not one of 'layernorm', 'rmsnorm'"),
    ("n_kv_heads", 2.5, r"model\.n_kv_heads: expected an integer, got 2\.5"),
])
def test_wrong_types_name_the_key_and_value(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_model_config("tiny", **{key: value})


@pytest.mark.unit
def test_model_refuses_a_layout_it_cannot_split_exactly():
    with pytest.raises(ConfigError, match=r"parallel\.tp=4 must divide the model.s ffn_hidden \(50\)"):
        GPT(dataclasses.replace(BASE, ffn_hidden=50), ParallelState(tp_size=4))


@pytest.mark.unit
def test_yaml_exponents_without_a_dot_are_numbers():
    assert load_model_config("tiny", norm_eps="1e-5").norm_eps == 1e-5


@pytest.mark.unit
def test_optional_fields_accept_null_and_ints_become_floats():
    cfg = load_model_config("tiny", n_kv_heads=None, dropout=0)
    assert cfg.n_kv_heads is None and isinstance(cfg.dropout, float)


@pytest.mark.unit
def test_missing_preset_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"model config 'gpt5' not found \(presets: gemma3-1b, gpt2-medium, gpt2-small, llama-1b, qwen3-0.6b, tiny\)"):
        load_model_config("gpt5")


@pytest.mark.unit
@pytest.mark.parametrize("changes,tp,world,message", [
    (dict(hidden=60), 1, 1, r"model\.hidden=60 is not divisible by model\.n_heads=8: choose n_heads among \[1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60\]"),
    (dict(n_kv_heads=3), 1, 1, r"model\.n_heads=8 is not divisible by model\.n_kv_heads=3: choose n_kv_heads among \[1, 2, 4, 8\]"),
    (dict(hidden=40, n_heads=8, position="rotary"), 1, 1, r"rotary positions need an even head dim, got 5"),
    ({}, 2, 3, r"^invalid config: parallel\.tp=2 must divide the world size 3: use parallel\.tp among \[1\] \(the divisors of the world size 3 that split the model\) or launch a multiple of 2 processes$"),
    ({}, 16, 16, r"^invalid config: parallel\.tp=16 must divide the model's heads \(8\): use parallel\.tp among \[1, 2, 4, 8\] \(the divisors of the world size 16 that split the model\)$"),
    (dict(n_kv_heads=2), 8, 8, None),  # kv=2 < tp=8 divides it: valid, copies of KV heads
    (dict(n_heads=12, n_kv_heads=6, hidden=48), 4, 4, r"parallel\.tp=4 must divide the model's KV heads \(6\): use parallel\.tp among \[1, 2\] \(the divisors of the world size 4 that split the model\)$"),
    (dict(n_heads=12, n_kv_heads=2, hidden=48), 4, 4, None),
    (dict(ffn_hidden=250), 4, 4, r"parallel\.tp=4 must divide the model's ffn_hidden \(250\): use parallel\.tp among \[1, 2\] \(the divisors of the world size 4 that split the model\)$"),
    (dict(vocab_pad_multiple=2, vocab_size=1001), 4, 4, r"parallel\.tp=4 must divide the model's padded vocab \(1002\): use parallel\.tp among \[1, 2\] \(the divisors of the world size 4 that split the model\), or a model\.vocab_pad_multiple that is a multiple of 4$"),
    (dict(dropout=1.0), 1, 1, r"model\.dropout=1\.0 must be in \[0, 1\)"),
    (dict(n_layers=0), 1, 1, r"model\.n_layers=0 must be >= 1"),
    (dict(max_seq_len=0), 1, 1, r"model\.max_seq_len=0 must be >= 1"),
    (dict(norm_eps=0.0), 1, 1, r"model\.norm_eps=0\.0 must be > 0"),
    (dict(init_std=-1.0), 1, 1, r"model\.init_std=-1\.0 must be > 0"),
    ({}, 0, 1, r"parallel\.tp=0 must be >= 1"),
])
def test_each_layout_error_names_values_and_fix(changes, tp, world, message):
    cfg = dataclasses.replace(BASE, **changes)
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
