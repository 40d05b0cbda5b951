"""Small model configs and padded batches shared by the model tests."""
import torch

from megalite.config import ModelConfig
from megalite.typed_config import replaced
from megalite.run_config import load_model_config
from megalite.parallel.context import gather_sequence
from megalite.parallel.mappings import all_gather, group_size
from megalite.parallel.sharding import Shard
from megalite.parallel.state import ParallelState

PAD_ID = 5  # deliberately not 0; also a real token id, so only the mask may say what is padding

CONFIGS = {
    "gpt2": load_model_config("tiny", vocab_size=100, max_seq_len=32, hidden=32),
    # GQA with n_kv_heads=2 < tp=4: ranks keep copies of the KV head their queries share.
    "llama": load_model_config("tiny", vocab_size=100, max_seq_len=32, hidden=32,
                               attention={"n_kv_heads": 2}, positions={"kind": "rotary"},
                               mlp={"activation": "swiglu", "ffn_hidden": 48},
                               norms={"kind": "rmsnorm"}, bias=False, tie_embeddings=False),
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


def gather_full(local: torch.Tensor, shard: Shard | None, pstate: ParallelState) -> torch.Tensor:
    """The full tensor (weight, gradient, optimizer moment) whose slice `local` is, on every rank.

    A collective over the TP group when `shard` is not None: every TP rank must call it.
    """
    if shard is None or group_size(pstate.tp_group) == 1:
        return local
    parts = all_gather(local.unsqueeze(0), 0, pstate.tp_group)
    copies = pstate.tp_size // shard.count
    return torch.cat(list(parts[::copies]), dim=shard.dim)


def same_on_all_ranks(x: torch.Tensor, group) -> bool:
    copies = all_gather(x.unsqueeze(0), 0, group)
    return all(torch.equal(c, copies[0]) for c in copies)


def with_changes(cfg: ModelConfig, changes: dict) -> ModelConfig:
    """`cfg` with each dotted key of `changes` replaced (typed_config.replaced)."""
    for key, value in changes.items():
        cfg = replaced(cfg, key, value)
    return cfg
