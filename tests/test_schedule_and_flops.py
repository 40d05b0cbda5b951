"""Numbers the parity tests cannot check (every layout shares them): schedule, FLOPs, labels."""
import json

import pytest
import torch

from megalite.config import load_model_config
from megalite.data.batches import Samples
from megalite.data.prepare import prepare_data
from megalite.run_config import DataConfig, TrainConfig
from megalite.training.metrics import flops_per_token, matmul_params
from megalite.training.optim import lr_at


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


def test_packed_labels_never_cross_a_document_boundary(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i} " + "word " * (i % 5)}) + "\n" for i in range(20)))
    data = prepare_data(DataConfig(path=str(path), bpe_vocab_size=300, val_fraction=0.0,
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
