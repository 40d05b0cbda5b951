"""Llama 3.x checkpoints: rotary scaling (rope_type llama3 and linear) and Llama 3.2's tied
embeddings, imported, evaluated, generated from and exported, checked against transformers
itself (CPU, fp32), with a Llama-3-shaped tokenizer (bos put first by its template, no pad)."""
import json
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from megalite.config import (LinearScaling, Llama3Scaling, ModelConfig, ParallelConfig, Rotary,
                             Unscaled)
from megalite.run_config import load_model_config
from megalite.plan import check_layout
from megalite.data.tokenizer import load_tokenizer
from megalite.hf import llama
from megalite.hf.convert import (checkpoint_model_config, export_hf, import_hf, load_pretrained,
                                 pretrained_config)
from megalite.model import GPT
from megalite.model.positions import inverse_frequencies
from megalite.parallel.state import ParallelState
from megalite.training.checkpoint import load_checkpoint
from megalite.typed_config import ConfigError, from_dict, replaced
from tests.support.harness import run_distributed
from tests.support.models import full_sequence

VOCAB = 320  # the models that need no tokenizer
TOL = dict(atol=1e-5, rtol=1e-5)
TEXT = "tensor parallel training of language models, with pipelines and long contexts. " * 10
NEW_TOKENS = 16
# head_dim 16 at Llama 3's theta: with a pretraining context of 64, the wavelengths (6, 32, 167,
# ... positions) fall in all three of llama3's ranges: kept, blended, divided by the factor.
# max_position_embeddings 128: evaluation windows and generation run past position 64.
SHAPE = dict(max_position_embeddings=128, hidden_size=64, num_attention_heads=4,
             num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=500000.0,
             initializer_range=0.3)  # so that greedy decoding does not repeat one token
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
MODELS = {  # Llama 3.1 (GQA, untied), Llama 3.2 (tied embeddings, one KV head: TP2 copies it)
    "llama3.1": dict(SHAPE, intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=False,
                     rope_scaling=dict(LLAMA3_ROPE, factor=8.0)),
    "llama3.2": dict(SHAPE, intermediate_size=80, num_key_value_heads=1, tie_word_embeddings=True,
                     rope_scaling=dict(LLAMA3_ROPE, factor=32.0)),
}


def hf_lib():
    """transformers, imported by the tests: not at import time, so that the ranks, which import
    this module to run their function, start fast."""
    return pytest.importorskip("transformers")


def save_hf_model(config, directory, seed=0):
    torch.manual_seed(seed)
    model = hf_lib().LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> (transformers model, its directory, the megalite checkpoint imported from it)."""
    from tests.support.tokenizer_shapes import llama3_shaped
    root = tmp_path_factory.mktemp("llama3")
    tokenizer = llama3_shaped(root / "tokenizer")
    vocab = load_tokenizer(tokenizer).vocab_size  # its special tokens last, as Llama 3's
    out = {}
    for i, (name, kwargs) in enumerate(MODELS.items()):
        hf = save_hf_model(hf_lib().LlamaConfig(**kwargs, vocab_size=vocab), root / name, seed=i)
        for file in tokenizer.iterdir():
            (root / name / file.name).write_bytes(file.read_bytes())
        import_hf(root / name, root / f"{name}-ckpt")
        out[name] = (hf, root / name, root / f"{name}-ckpt")
    return out


def windows(ids: list[int], length: int) -> list[torch.Tensor]:
    return [torch.tensor([ids[i:i + length]]) for i in range(0, len(ids), length)]


def hf_text_loss(hf, ids: list[int], length: int) -> float:
    """megalite eval's loss computed with transformers: the mean over consecutive windows."""
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows(ids, length):
            n = window.shape[1] - 1
            total, count = total + hf(input_ids=window, labels=window).loss.item() * n, count + n
    return total / count


def prompts(ids: list[int]) -> list[list[int]]:
    """Two prompts of different lengths (left-padded together), reaching past position 64."""
    return [ids[:70], ids[7:52]]


def on_two_ranks(models: dict[str, tuple[str, str]], ids: list[int]) -> dict:
    """Per model: the text loss at TP2 (megalite eval's computation), greedy tokens at TP2 and at
    PP2 (the KV cache), the first window's logits at CP2; and whether train.init_from's sliced
    read of the Hugging Face directory gives the imported weights at TP2."""
    from megalite.evaluate import windows_loss
    from megalite.generate import generate
    tp2 = ParallelState.from_world(2)
    cp2 = ParallelState.from_world(1, pipeline=ParallelConfig(cp=2))
    pp2 = ParallelState.from_world(1, pipeline=ParallelConfig(pp=2))
    out = {}
    for name, (hf_dir, ckpt) in models.items():
        cfg = checkpoint_model_config(ckpt)
        pad = load_tokenizer(Path(ckpt) / "tokenizer.json").pad_id  # no pad token: eos fills
        model = GPT(cfg, tp2, init=False)
        load_checkpoint(ckpt, model, tp2)
        from_hf = GPT(pretrained_config(hf_dir), tp2, init=False)
        load_pretrained(hf_dir, from_hf, tp2)
        same = all(torch.equal(p, dict(from_hf.named_parameters())[k])
                   for k, p in model.named_parameters())
        loss_sum, count = windows_loss(model, ids, pad).tolist()
        tp_tokens = generate(model, prompts(ids), NEW_TOKENS, pad_id=pad)

        model = GPT(cfg, pp2, init=False)
        load_checkpoint(ckpt, model, pp2)
        pp_tokens = generate(model, prompts(ids), NEW_TOKENS, pad_id=pad)

        model = GPT(cfg, cp2, init=False).eval()
        load_checkpoint(ckpt, model, cp2)
        with torch.no_grad():
            logits = model(windows(ids, cfg.max_seq_len)[0]).logits
            cp_logits = full_sequence(model, model.full_logits(logits))
        out[name] = dict(same=same, loss=loss_sum / count, count=count, tp=tp_tokens, pp=pp_tokens,
                         cp=cp_logits)
    return out


def hf_generate(hf, rows: list[list[int]], pad: int) -> list[list[int]]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                      do_sample=False, eos_token_id=None, pad_token_id=pad)
    return out[:, width:].tolist()


@pytest.mark.unit
def test_llama3_rope_scaling_changes_the_frequencies_in_all_three_ranges(imported):
    for name, (hf, hf_dir, ckpt) in imported.items():
        cfg = checkpoint_model_config(ckpt)
        scaled = inverse_frequencies(cfg)
        assert cfg.positions.scaling.kind == "llama3" and torch.equal(scaled, hf.model.rotary_emb.inv_freq)
        ratio = scaled / inverse_frequencies(replaced(cfg, "positions.scaling", Unscaled()))
        factor = MODELS[name]["rope_scaling"]["factor"]
        kept, divided = ratio == 1, torch.isclose(ratio, torch.tensor(1 / factor), rtol=1e-6)
        assert kept.any() and divided.any() and not (kept | divided).all(), ratio


@pytest.mark.exactness
def test_llama3_models_imported_at_tp2_cp2_pp2_equal_transformers(imported):
    """Llama 3.1 and 3.2 shapes: the eval loss on text longer than the pretraining context,
    greedy generation (KV cache, two left-padded prompts past position 64) at TP2 and PP2, the
    logits at CP2; train.init_from reads the same weights."""
    _, hf_dir, ckpt = next(iter(imported.values()))
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    ids = tokenizer.encode(TEXT)  # as megalite eval encodes the text: bos first
    assert ids == hf_lib().AutoTokenizer.from_pretrained(hf_dir)(TEXT).input_ids
    assert ids[0] == tokenizer.bos_id and len(ids) > 2 * 128
    results = run_distributed(on_two_ranks, 2, {name: (str(d), str(c)) for name, (_, d, c)
                                                in imported.items()}, ids)
    for name, (hf, _, _) in imported.items():
        ours = results[0][name]
        assert ours["same"] and results[1][name]["same"]
        assert_close(torch.tensor(ours["loss"]), torch.tensor(hf_text_loss(hf, ids, 128)), **TOL)
        assert ours["count"] == len(ids) - len(windows(ids, 128))
        theirs = hf_generate(hf, prompts(ids), tokenizer.pad_id)
        assert ours["tp"] == theirs and ours["pp"] == theirs and results[1][name]["pp"] == theirs
        assert all(len(set(row)) > 3 for row in theirs), theirs
        with torch.no_grad():
            hf_logits = hf(input_ids=windows(ids, 128)[0]).logits
        assert_close(ours["cp"], hf_logits, **TOL)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(MODELS))
def test_exported_llama3_model_loads_in_transformers_with_the_same_loss(imported, tmp_path, name):
    hf, hf_dir, ckpt = imported[name]
    export_hf(ckpt, tmp_path / "hf", torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_parameters"] == {**MODELS[name]["rope_scaling"], "rope_theta": 500000.0}
    assert config["tie_word_embeddings"] == MODELS[name]["tie_word_embeddings"]
    back = hf_lib().AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert torch.equal(back.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    tied = MODELS[name]["tie_word_embeddings"]
    # Tied: no lm_head.weight in the file; transformers makes the head the embedding.
    assert ("lm_head.weight" in stored) != tied
    assert (back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()) == tied
    ids = load_tokenizer(hf_dir).encode(TEXT)
    assert hf_lib().AutoTokenizer.from_pretrained(tmp_path / "hf")(TEXT).input_ids == ids
    assert_close(torch.tensor(hf_text_loss(back, ids, 128)),
                 torch.tensor(hf_text_loss(hf, ids, 128)), **TOL)


@pytest.mark.unit
@pytest.mark.parametrize("written", ["rope_parameters", "rope_scaling"])
def test_linear_scaled_model_gives_transformers_logits(tmp_path, written):
    """Linear scaling, from transformers 5's rope_parameters or an older config.json's
    rope_scaling {"type": "linear"} beside rope_theta."""
    kwargs = dict(MODELS["llama3.1"], rope_scaling={"rope_type": "linear", "factor": 4.0},
                  initializer_range=0.02)
    hf = save_hf_model(hf_lib().LlamaConfig(**kwargs, vocab_size=VOCAB), tmp_path)
    if written == "rope_scaling":
        config = json.loads((tmp_path / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "linear", "factor": 4})
        (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = pretrained_config(tmp_path)
    assert (cfg.positions.scaling.kind, cfg.positions.scaling.factor,
            cfg.positions.theta) == ("linear", 4.0, 500000.0)
    assert_close(inverse_frequencies(cfg),
                 inverse_frequencies(replaced(cfg, "positions.scaling", Unscaled())) / 4)
    model = GPT(cfg, ParallelState(), init=False)
    load_pretrained(tmp_path, model, ParallelState())
    ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(model.full_logits(model(ids).logits), hf(input_ids=ids).logits, **TOL)


@pytest.mark.unit
@pytest.mark.parametrize("scaling", [
    dict(kind="none"), dict(kind="linear", factor=2.5),
    dict(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_seq_len=64)])
def test_rope_scaling_written_for_transformers_reads_back_the_same(tmp_path, scaling):
    """A megalite model config's rotary scaling (a YAML can train one from scratch), as export
    writes it: transformers computes megalite's frequencies, and import reads the same config."""
    cfg = load_model_config("tiny", vocab_size=VOCAB, max_seq_len=128, hidden=64, n_heads=4,
                            bias=False, attention=dict(n_kv_heads=4),
                            positions=dict(kind="rotary", theta=500000.0, scaling=scaling),
                            mlp=dict(activation="swiglu", ffn_hidden=96), norms=dict(kind="rmsnorm"))
    written = llama.config_to_hf(cfg, {})
    assert llama.config_from_hf(written) == cfg
    (tmp_path / "config.json").write_text(json.dumps(written))
    hf = hf_lib().LlamaForCausalLM(hf_lib().AutoConfig.from_pretrained(tmp_path))
    assert torch.equal(hf.model.rotary_emb.inv_freq, inverse_frequencies(cfg))


def write_llama_config(directory, **changes) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "max_position_embeddings": 128, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "rope_theta": 500000.0}
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


SUPPORTED = r"\(megalite computes rope_type 'default', 'linear', 'llama3', 'yarn'\)"


@pytest.mark.unit
@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "yarn", "factor": 4.0, "truncate": False}, "yarn with truncate=false"),
    ({"rope_type": "dynamic", "factor": 2.0}, f"rope scaling 'dynamic' {SUPPORTED}"),
    ({"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
     f"rope scaling 'longrope' {SUPPORTED}"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
     "rope scaling 'llama3' without 'low_freq_factor'"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5"),
])
def test_unsupported_rope_is_refused_naming_it(tmp_path, rope, message):
    write_llama_config(tmp_path, rope_scaling=rope)
    with pytest.raises(ConfigError, match=f"unsupported Llama checkpoint: {message}"):
        import_hf(tmp_path, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=f"unsupported Llama checkpoint: {message}"):
        pretrained_config(tmp_path)  # train.init_from


@pytest.mark.unit
@pytest.mark.parametrize("scaling,message", [
    (Llama3Scaling(high_freq_factor=1.0),
     r"model\.positions\.scaling\.high_freq_factor=1\.0 must be > low_freq_factor=1\.0"),
    (Llama3Scaling(low_freq_factor=0.0), r"model\.positions\.scaling\.low_freq_factor=0\.0 must be > 0"),
    (LinearScaling(factor=0.0), r"model\.positions\.scaling\.factor=0\.0 must be > 0"),
])
def test_bad_rope_scaling_values_are_config_errors(scaling, message):
    cfg = ModelConfig(positions=Rotary(scaling=scaling))
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, ParallelConfig(), 1)


@pytest.mark.unit
def test_rope_scaling_of_learned_positions_is_refused_by_the_loader():
    # A scaling is model.positions.kind=rotary's own: learned positions have none to write
    # (before the sections, check_layout refused it as scaling nothing).
    with pytest.raises(ConfigError, match=r"model\.positions\.scaling is a key of "
                                          r"model\.positions\.kind=rotary, and "
                                          r"model\.positions\.kind=learned"):
        from_dict(ModelConfig, {"positions": {"kind": "learned",
                                              "scaling": {"kind": "linear", "factor": 2.0}}}, "model.")
