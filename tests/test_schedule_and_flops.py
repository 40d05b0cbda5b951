"""Numbers the parity tests cannot check (every layout shares them): schedule, FLOPs, labels."""
import json

import pytest
import torch

from megalite.run_config import load_model_config
from megalite.data.batches import Samples
from megalite.prep.command import prepare_for_run
from megalite.run_config import DataConfig, TrainConfig
from megalite.training.metrics import flops_per_token, matmul_params
from megalite.training.optim import lr_at

pytestmark = pytest.mark.unit


def test_warmup_then_cosine_to_min_lr():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.55)  # half-way: (1 + 0.1) / 2
    assert lr_at(14, cfg) == pytest.approx(0.1)
    assert lr_at(100, cfg) == pytest.approx(0.1)


def test_flops_per_token_matches_the_published_gpt2_small_figure():
    cfg = load_model_config("gpt2-small")
    # 124M parameters: 85M in the blocks' matmuls and the 38.6M head (tied to the embedding),
    # ~855 MFLOP per token at s=1024 (reference.md, PaLM appendix B).
    assert matmul_params(cfg) == 12 * 12 * 768 ** 2 + 50257 * 768
    assert flops_per_token(cfg, 1024) / 1e6 == pytest.approx(854.4, abs=0.1)
    llama = load_model_config("llama-1b")
    blocks = 16 * (2048 * 2048 * 2 + 2048 * 2 * 8 * 64 + 3 * 2048 * 8192)
    assert matmul_params(llama) == blocks + 128256 * 2048


def test_flops_per_token_counts_free_head_widths_and_sliding_windows():
    """Gemma 3 1B: 4 heads of 256 (1024 wide, hidden 1152), 4 global layers of 26 (5, 11, 17,
    23), the others seeing a window of 512 at s=4096; GeGLU's three matrices."""
    cfg = load_model_config("gemma3-1b")
    attention = 1152 * 4 * 256 * 2 + 1152 * 2 * 1 * 256
    assert matmul_params(cfg) == 26 * (attention + 3 * 1152 * 6912) + 262144 * 1152
    assert [i for i in range(26) if cfg.window_of(i) is None] == [5, 11, 17, 23]
    seen = 4 * 4096 + 22 * 512
    assert flops_per_token(cfg, 4096) == 6 * matmul_params(cfg) + 12 * 1024 * seen
    # Below the window, every layer sees the whole sequence.
    assert flops_per_token(cfg, 256) == 6 * matmul_params(cfg) + 12 * 1024 * 26 * 256


def test_flops_per_token_count_latent_attention_and_the_experts_a_token_uses():
    """DeepSeek-V3 (671B, 37B active): MLA's down- and up-projections, 3 dense layers, 58 MoE
    layers of 8 routed + 1 shared expert of 2048 and the router; scores of 192 dims, values of
    128, over 128 heads."""
    from megalite.config import Experts, Latent, ModelConfig, Norms, Rotary
    cfg = ModelConfig(vocab_size=129280, n_layers=61, hidden=7168, n_heads=128,
                      attention=Latent(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                       qk_rope_head_dim=64, v_head_dim=128),
                      positions=Rotary(), norms=Norms(kind="rmsnorm"), bias=False,
                      mlp=Experts(activation="swiglu", ffn_hidden=18432, experts=256, top_k=8,
                                  expert_ffn_hidden=2048, shared_experts=1, dense_layers=(0, 1, 2)),
                      tie_embeddings=False)
    attention = (7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * (128 + 128)
                 + 128 * 128 * 7168)
    moe = 7168 * 256 + 3 * 7168 * (8 * 2048 + 2048)
    n = 61 * attention + 3 * 3 * 7168 * 18432 + 58 * moe + 129280 * 7168
    assert matmul_params(cfg) == n and 36e9 < n < 38e9  # the published 37B active, less embeddings
    assert flops_per_token(cfg, 4096) == 6 * n + 6 * 128 * (192 + 128) * 61 * 4096


def test_packed_labels_never_cross_a_document_boundary(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " + "word " * (i % 5)}) + "\n" for i in range(20)))
    data = prepare_for_run(DataConfig(path=str(path), bpe_vocab_size=300, val_fraction=0.0,
                                   cache_dir=str(tmp_path / "cache")))
    samples = Samples(data.train[0].docs, "packed", 16, data.tokenizer.pad_id)
    batch = samples.collate(range(len(samples)))
    eos = data.tokenizer.eos_id
    # Every document ends with eos, and what follows an eos starts another document: exactly
    # the eos positions predict nothing, every other token predicts its successor.
    assert torch.equal(batch.labels == -100, batch.input_ids == eos)
    inside = batch.labels[:, :-1] != -100
    assert torch.equal(batch.labels[:, :-1][inside], batch.input_ids[:, 1:][inside])
    assert torch.equal(batch.doc_ids[:, :-1][inside], batch.doc_ids[:, 1:][inside])
