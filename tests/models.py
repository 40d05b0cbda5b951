"""Small model configs and padded batches shared by the model tests."""
import torch

from megalite.config import ModelConfig, load_model_config
from megalite.parallel.context import gather_sequence

PAD_ID = 5  # deliberately not 0; also a real token id, so only the mask may say what is padding

CONFIGS = {
    "gpt2": load_model_config("tiny", vocab_size=100, max_seq_len=32, hidden=32),
    # GQA with n_kv_heads=2 < tp=4: ranks keep copies of the KV head their queries share.
    "llama": load_model_config("tiny", vocab_size=100, max_seq_len=32, hidden=32, n_kv_heads=2,
                               activation="swiglu", norm="rmsnorm", position="rotary",
                               bias=False, tie_embeddings=False, ffn_hidden=48),
}

LENGTHS = (12, 7, 3, 10)


def padded_batch(cfg: ModelConfig, side: str, lengths=LENGTHS, seed: int = 0):
    """ids, attention mask and next-token labels (-100 at padding) of ragged sequences."""
    generator = torch.Generator().manual_seed(seed)
    seq = max(lengths)
    ids = torch.full((len(lengths), seq), PAD_ID)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    labels = torch.full((len(lengths), seq), -100)
    for row, n in enumerate(lengths):
        tokens = torch.randint(0, cfg.vocab_size, (n,), generator=generator)
        span = slice(0, n) if side == "right" else slice(seq - n, seq)
        ids[row, span], mask[row, span] = tokens, 1
        labels[row, span] = torch.cat([tokens[1:], torch.tensor([-100])])
    return ids, mask, labels


def sequences(cfg: ModelConfig, lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    """The unpadded sequences of padded_batch(cfg, side, lengths, seed), one [1, n] tensor each."""
    ids, mask, _ = padded_batch(cfg, "right", lengths, seed)
    return [ids[row, : int(mask[row].sum())].unsqueeze(0) for row in range(len(lengths))]


def full_sequence(model, t: torch.Tensor) -> torch.Tensor:
    """A per-token output of this CP rank ([batch, seq share, ...]: logits, token losses) for
    the whole rows, in order (a collective over CP; no autograd)."""
    return gather_sequence(t, 1, model.pstate.cp_group)
