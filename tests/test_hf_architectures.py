"""The architectures people bring, against transformers itself (CPU, fp32): for each, a random
model of transformers' own (weights perturbed off their init, so that biases, norms and q/k
norms count) imported by `megalite import --from-hf`, evaluated by `megalite eval --tp 2` on
ranks with torchrun's environment (tests/test_hf_moe.py launches it with torchrun itself) with
transformers' loss on the same windows, exported back (`megalite export --dtype fp32`) and read by
AutoModelForCausalLM with the same loss, and
greedy generation at TP2 (through the KV cache) equal to transformers' generate. The sliding
windows are shorter than the eval windows and the generated text, so they are real."""
from functools import reduce

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megalite.hf.convert import checkpoint_model_config  # noqa: E402
from tests.support.hf import CONTEXT, VOCAB, run_cli, same_as_transformers  # noqa: E402

pytestmark = pytest.mark.exactness

SHAPE = dict(vocab_size=VOCAB, max_position_embeddings=CONTEXT, hidden_size=32,
             intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False)
# name -> (transformers config, what the import must read off it: model config key -> value)
ARCHITECTURES = {
    "qwen2": (lambda: transformers.Qwen2Config(**SHAPE),
              {"attention.qkv_bias": True, "attention.sliding_window": None}),
    "mistral": (lambda: transformers.MistralConfig(**SHAPE, head_dim=16, sliding_window=6),
                {"attention.head_dim": 16, "attention.sliding_window": 6,
                 "attention.sliding_window_pattern": 1}),
    "qwen3": (lambda: transformers.Qwen3Config(
        **{**SHAPE, "tie_word_embeddings": True}, head_dim=16, use_sliding_window=True,
        sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
        {"attention.head_dim": 16, "attention.qk_norm": True, "tie_embeddings": True,
         "attention.sliding_window": 5, "attention.sliding_window_pattern": 2}),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(
        **{**SHAPE, "num_hidden_layers": 3}, head_dim=16, moe_intermediate_size=24,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
        {"attention.head_dim": 16, "attention.qk_norm": True, "mlp.experts": 4,
         "mlp.dense_layers": (1,), "mlp.renormalize": True}),
    "gemma3": (lambda: transformers.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=6, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}}),
        {"attention.head_dim": 16, "attention.qk_norm": True, "attention.sliding_window": 6,
         "attention.sliding_window_pattern": 3, "positions.local_theta": 100.0,
         "positions.scaling.kind": "linear", "attention.query_pre_attn_scalar": 24.0,
         "norms.weight_offset": 1.0, "norms.post_norms": True, "scale_embeddings": True,
         "final_logit_softcap": 3.0}),
}


# Gemma's embeddings times sqrt(hidden): less noise, or greedy decoding repeats one token.
NOISE = {"gemma3": 0.1}


def random_model(name: str, directory, tokenizer_file):
    torch.manual_seed(0)
    config, _ = ARCHITECTURES[name]
    hf = transformers.AutoModelForCausalLM.from_config(config()).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the init: zero biases, unit norms and small weights hide errors
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * NOISE.get(name, 0.3))
    hf.save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    return hf


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_imported_architecture_evaluates_exports_and_generates_as_transformers(
        tmp_path, tokenizer_file, name):
    hf = random_model(name, tmp_path / "hf", tokenizer_file)
    run_cli("import", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "ckpt"))
    cfg = checkpoint_model_config(tmp_path / "ckpt")
    expected = {"architecture": type(hf).__name__, **ARCHITECTURES[name][1]}
    assert {key: reduce(getattr, key.split("."), cfg) for key in expected} == expected
    same_as_transformers(hf, tmp_path, [["--ep", "2"]] if cfg.n_experts else [[]])


