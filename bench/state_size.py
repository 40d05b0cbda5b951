"""Per-rank bytes of training state at scale, on paper: what a checkpoint writes and stages in
host memory, and what the optimizer keeps, for a model config and a TP x CP x PP x DP layout.

    python -m bench.state_size      # the table of docs/checkpoints.md

The counts follow the model's own shapes (tests/test_state_size.py checks them against built
models, and the bytes against benchmarks/checkpoint's measured writes). A checkpoint holds
fp32 weights and both fp32 Adam moments (12 bytes per parameter); every replica of a slice
writes its rows of it, so a rank writes and stages 12 / (dp x cp) bytes per parameter of its
slice. The optimizer: fp32 weights and gradients (4 + 4) and Adam's moments (8), or under
pure_bf16 bf16 weights, fp32 gradients (2 + 4) and fp32 masters and moments (12); zero_stage=1
divides the masters and moments over the dp x cp replicas, as Megatron's distributed optimizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megalite.config import Dense, GroupedQuery, ModelConfig, Norms, Rotary

GB = 1e9


def layer_params(cfg: ModelConfig) -> int:
    """One transformer block: attention (q, the fused k/v, out), the MLP, two norms."""
    h, kv = cfg.hidden, 2 * cfg.kv_heads * cfg.head_size
    mlp_mats = 3 if cfg.gated else 2
    weights = 2 * h * h + kv * h + mlp_mats * h * cfg.ffn
    norms = 2 * h * (2 if cfg.norms.kind == "layernorm" else 1)
    biases = (h + kv + h + cfg.ffn + h) if cfg.bias else 0
    return weights + norms + biases


def _ends(cfg: ModelConfig) -> tuple[int, int]:
    """The first stage's embedding (+ learned positions); the last one's final norm (+ LM head
    when untied: with pipeline stages a tied embedding's copy too)."""
    vocab = cfg.padded_vocab * cfg.hidden
    positions = cfg.max_seq_len * cfg.hidden if cfg.positions.kind == "learned" else 0
    final_norm = cfg.hidden * (2 if cfg.norms.kind == "layernorm" else 1)
    return vocab + positions, final_norm + (0 if cfg.tie_embeddings else vocab)


def model_params(cfg: ModelConfig) -> int:
    return cfg.n_layers * layer_params(cfg) + sum(_ends(cfg))


def rank_params(cfg: ModelConfig, tp: int, pp: int) -> int:
    """The parameters of the largest rank's TP slice: its stage's blocks (the first stages take
    the extra ones when pp does not divide the layers) and the embedding or the LM head with the
    final norm. Norms (and GPT-2's biases of the row-split projections) are counted as split,
    which they are not: a bias on the count of at most a few hidden sizes."""
    blocks = math.ceil(cfg.n_layers / pp) * layer_params(cfg)
    first, last = _ends(cfg)
    if pp > 1 and cfg.tie_embeddings:
        last += cfg.padded_vocab * cfg.hidden
    return (blocks + (first + last if pp == 1 else max(first, last))) // tp


@dataclass(frozen=True)
class StateBytes:
    params: int  # of the largest rank's slice
    checkpoint: float  # written by that rank, and staged in its host memory, per save
    optimizer_zero0: float  # weights, gradients, masters and Adam moments on the device
    optimizer_zero1: float


def state_bytes(cfg: ModelConfig, tp: int, pp: int, dp: int, cp: int = 1,
                pure_bf16: bool = False) -> StateBytes:
    n, replicas = rank_params(cfg, tp, pp), dp * cp
    kept, sharded = (6, 12) if pure_bf16 else (8, 8)
    return StateBytes(n, 12 * n / replicas, (kept + sharded) * n, (kept + sharded / replicas) * n)


def _llama(vocab: int, layers: int, hidden: int, heads: int, kv_heads: int | None, ffn: int,
           seq: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, n_layers=layers, hidden=hidden, n_heads=heads,
                       attention=GroupedQuery(n_kv_heads=kv_heads), positions=Rotary(),
                       mlp=Dense(ffn_hidden=ffn, activation="swiglu"), norms=Norms(kind="rmsnorm"),
                       bias=False, tie_embeddings=False, max_seq_len=seq)


LLAMA_7B = _llama(32000, 32, 4096, 32, None, 11008, 4096)
LLAMA_70B = _llama(128256, 80, 8192, 64, 8, 28672, 8192)
LLAMA_405B = _llama(128256, 126, 16384, 128, 8, 53248, 8192)
# (name, model, tp, pp, dp): layouts of the size such models are trained at.
SCALES = [("Llama 2 7B", LLAMA_7B, 4, 1, 16), ("Llama 3 70B", LLAMA_70B, 8, 8, 16),
          ("Llama 3.1 405B", LLAMA_405B, 8, 16, 16)]


def table(write_gb_per_s: float = 1.0) -> str:
    """The markdown table of docs/checkpoints.md, pure_bf16 (Megatron's 18 bytes per parameter)."""
    lines = ["| model | layout | params per rank | checkpoint per rank (written, host) | "
             f"write at {write_gb_per_s:g} GB/s per rank | rank 0 before sharding | "
             "optimizer per GPU, zero 0 | zero 1 |", "|---|---|---|---|---|---|---|---|"]
    for name, cfg, tp, pp, dp in SCALES:
        s = state_bytes(cfg, tp, pp, dp, pure_bf16=True)
        whole = 12 * model_params(cfg)  # rank 0 gathered every stage's full tensors
        lines.append(f"| {name} | TP{tp} x PP{pp} x DP{dp} | {s.params / 1e9:.2f} B | "
                     f"{s.checkpoint / GB:.2f} GB | {s.checkpoint / GB / write_gb_per_s:.1f} s | "
                     f"~{whole / GB:,.0f} GB | {s.optimizer_zero0 / GB:.1f} GB | "
                     f"{s.optimizer_zero1 / GB:.1f} GB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
