"""The end of the model: the LM head and its loss, one part whatever the architecture.

    logits_r = f(x) E_r^T        this rank's vocab rows E_r (its own, or the tied embedding's),
                                 soft-capped where the model says, padding at -inf
    loss = vocab-parallel cross-entropy of logits_r, fused with the head in chunks of tokens
                                 (parallel/head_loss.py): the logits are never whole

x enters the TP region through f, or sequence parallel through the SP paper's g (all-gather of
the shards); the rows padded to SP's shards are cut from the logits and ignored by the loss.
"""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.parallel.head_loss import HeadShard, head_loss_sum, head_token_losses, soft_cap
from megalite.parallel.init import new_param
from megalite.parallel.layers import column_parallel_linears
from megalite.parallel.mappings import (copy_to_tensor_parallel_region,
                                        gather_from_sequence_parallel_region)
from megalite.parallel.sharding import mark_sharded
from megalite.parallel.contexts import TensorParallel
from megalite.parallel.vocab import IGNORE_INDEX, VocabParallelEmbedding


class LMHead(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel,
                 tied: VocabParallelEmbedding | None, chunk_tokens: int):
        """tied: the embedding whose rows are the head's (no weight of its own then).
        chunk_tokens: tokens per chunk of the fused head + loss."""
        super().__init__()
        local, self.tp = cfg.padded_vocab // tp.size, tp
        self._tied = (tied,)  # a tuple: the embedding stays registered where it is, once
        if tied is None:
            self.weight = mark_sharded(new_param(local, cfg.hidden, std=cfg.init_std), 0, tp.rank, tp.size)
        # Columns past the real vocabulary get -inf logits: no probability mass, no gradient.
        # They are the last columns of the last ranks.
        start = tp.rank * local
        padded_from = max(0, cfg.vocab_size - start)
        self.shard = HeadShard(start, padded_from if padded_from < local else None,
                               tp.group, chunk_tokens, cfg.final_logit_softcap)

    @property
    def rows(self) -> nn.Parameter:
        """E_r, this rank's vocab rows: tied or not, the head is that matrix applied after f."""
        return self.weight if self._tied[0] is None else self._tied[0].weight

    def logits(self, x: torch.Tensor, seq: int) -> torch.Tensor:
        """[batch, seq, padded_vocab / tp] of the final hidden states x (a shard of them under
        SP), without the padding to shards."""
        shard = self.shard
        logits, = column_parallel_linears(x, self.tp, (self.rows, None))
        logits = soft_cap(logits[:, :seq], shard.cap)
        if shard.padded_from is not None:
            padding = torch.arange(logits.shape[-1], device=logits.device) >= shard.padded_from
            logits = logits.masked_fill(padding, float("-inf"))
        return logits

    def forward(self, x: torch.Tensor, labels: torch.Tensor, seq: int,
                loss_scale: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(per-token losses [batch, seq], and with loss_scale their sum x loss_scale, whose
        gradients are made here in forward; the losses are then not differentiable)."""
        x = (gather_from_sequence_parallel_region(x, self.tp.group) if self.tp.sharded
             else copy_to_tensor_parallel_region(x, self.tp.group))
        batch, padded_seq = x.shape[:2]
        labels = F.pad(labels, (0, padded_seq - seq), value=IGNORE_INDEX)  # SP's padding
        x, labels = x.reshape(batch * padded_seq, -1), labels.reshape(-1)
        if loss_scale is None:
            losses, loss = head_token_losses(x, self.rows, labels, self.shard), None
        else:
            loss, losses = head_loss_sum(x, self.rows, labels, loss_scale, self.shard)
        return losses.view(batch, padded_seq)[:, :seq], loss
