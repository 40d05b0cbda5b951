"""Hugging Face mixtures of experts in and out, checked against transformers itself (CPU, fp32):
a random MixtralForCausalLM imported and evaluated by `megalite eval` at EP2 x TP2 gives
transformers' loss, and exported back, transformers loads it and gives the same logits; a random
Qwen2MoeForCausalLM (a gated shared expert, q/k/v biases, top-k not renormalised) imported gives
its logits at EP2, and exported back, transformers' own."""
import json

import pytest
import torch
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")

from megalite.hf.convert import checkpoint_model_config, export_hf, import_hf  # noqa: E402
from megalite.model import GPT  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.training.checkpoint import load_checkpoint  # noqa: E402
from megalite.config import ParallelConfig  # noqa: E402
from tests.support.harness import run_distributed  # noqa: E402
from tests.support.hf import CONTEXT, VOCAB, transformers_loss  # noqa: E402
from tests.support.launch import run, torchrun  # noqa: E402

pytestmark = pytest.mark.exactness


def random_mixtral(directory, tokenizer_file):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, max_position_embeddings=CONTEXT, hidden_size=32, intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False, rms_norm_eps=1e-5, sliding_window=None)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    return model


def test_mixtral_round_trip_and_eval_at_ep2_tp2(tmp_path, tokenizer_file):
    hf = random_mixtral(tmp_path / "hf", tokenizer_file)
    cfg = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert (cfg.n_experts, cfg.mlp.top_k, cfg.expert_ffn) == (4, 2, 24)
    text = tmp_path / "text.txt"
    text.write_text("tensor parallel training of language models, " * 40)  # > 3 windows
    done = run(torchrun(4) + ["-m", "megalite", "eval", "--ckpt", str(tmp_path / "ckpt"),
                              "--text", str(text), "--tp", "2", "--ep", "2", "--json"])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok(text.read_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    loss, count = transformers_loss(hf, ids)
    assert len(ids) > 3 * CONTEXT and result["tokens"] == count
    assert result["loss"] == pytest.approx(loss, abs=1e-5)

    # Exported back: transformers reads the same model.
    assert export_hf(tmp_path / "ckpt", tmp_path / "out", torch.float32) == "MixtralForCausalLM"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert transformers_loss(back, ids)[0] == pytest.approx(loss, abs=1e-6)
    model = GPT(checkpoint_model_config(tmp_path / "ckpt"), ParallelState(), init=False)
    load_checkpoint(tmp_path / "ckpt", model, ParallelState())
    window = ids[:CONTEXT].unsqueeze(0)
    with torch.no_grad():
        assert_close(model.full_logits(model(window).logits), back(input_ids=window).logits,
                     atol=1e-5, rtol=1e-5)


def logits_at_ep(ep: int, ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    ps = ParallelState.from_world(1, pipeline=ParallelConfig(ep=ep)) if ep > 1 else ParallelState()
    model = GPT(checkpoint_model_config(ckpt), ps, init=False)
    load_checkpoint(ckpt, model, ps)
    with torch.no_grad():
        return model.full_logits(model(ids).logits)


def test_qwen2_moe_round_trip_at_ep2(tmp_path, tokenizer_file):
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, max_position_embeddings=CONTEXT, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=24, shared_expert_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False, rms_norm_eps=1e-5)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers inits the q/k/v biases to zeros: make them count
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    cfg = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert (cfg.mlp.shared_experts, cfg.mlp.shared_gate, cfg.mlp.renormalize,
            cfg.attention.qkv_bias) == (2, True, False, True)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    for ours in run_distributed(logits_at_ep, 2, 2, str(tmp_path / "ckpt"), ids):
        assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert export_hf(tmp_path / "ckpt", tmp_path / "out", torch.float32) == "Qwen2MoeForCausalLM"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert_close(back(input_ids=ids).logits, theirs, atol=1e-6, rtol=1e-6)
