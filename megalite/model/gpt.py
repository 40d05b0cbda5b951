"""A decoder-only transformer (GPT-2 / Llama family) with every large matrix split across TP ranks.

    x = embed(ids) [+ positions]                   vocab-parallel embedding, g
    for each block:
        x = x + dropout(attention(norm(x)))        heads split: f ... g
        x = x + dropout(mlp(norm(x)))              A by columns, B by rows: f ... g
    logits_r = f(norm(x)) E_r^T                    this rank's vocab columns, never gathered
    loss = cross_entropy(logits_r, labels)         vocab-parallel (three all-reduces of [tokens]),
                                                   fused with the head, in chunks of tokens:
                                                   the logits are never whole (head_loss.py)

Sequence parallelism (TensorParallel.sharded, Korthikanti et al. 2022) keeps x split along
the sequence, a 1/tp shard of the tokens per rank, wherever it is outside a TP region: the
embedding's g becomes the SP paper's g-bar (reduce-scatter), every f becomes its g (all-gather
the shards; reduce-scatter backward) and every g its g-bar, so norms, dropout and residual adds
run on the shard. Dropout there uses the per-rank generator; replicated parameters used on the
shard (norms, row-parallel biases, positions) sum their gradients over TP. Inputs are padded
to a multiple of tp tokens at the end (model/inputs.py: what each rank runs of a batch), and
the padding is cut from the logits. A forward with a KV cache (generation) runs without it.

What is split how:
| module                | weight split                | communication              |
|-----------------------|-----------------------------|----------------------------|
| embed                 | vocab rows                  | all-reduce forward         |
| attention.q_proj      | output (heads)              | shares attention's f       |
| attention.kv_proj     | output (KV heads; copies    | shares attention's f;      |
|                       | when n_kv_heads < tp)       | copies' grads summed       |
| attention.out_proj    | input (heads)               | all-reduce forward (g)     |
| mlp.gate, mlp.up      | output (ffn)                | shares the MLP's f         |
| mlp.down              | input (ffn)                 | all-reduce forward (g)     |
| head (or tied embed)  | vocab rows                  | f: all-reduce backward     |
| norms, positions, row-parallel biases | replicated  | none; SP: grads all-reduced |

Pipeline parallelism (pstate.pp_size > 1) builds only this rank's model chunks
(pipeline/stages.py): its blocks keep their global layer numbers, so parameter names, init and
checkpoints are those of the whole model. The first virtual stage embeds, the last holds the
final norm and the head; with tied embeddings the last stage holds its own copy of the
embedding, identical at init (drawn by name), whose gradient is summed with the first stage's.
"""
from functools import cached_property, partial
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalite.config import ModelConfig, ParallelConfig
from megalite.model.attention import Attention
from megalite.model.latent_attention import LatentAttention
from megalite.model.kv_cache import KVCache
from megalite.model.inputs import RankInputs, RankSplit
from megalite.model.mlp import MLP
from megalite.model.moe import MoE
from megalite.model.norm import Norm
from megalite.model.positions import LearnedPositions, Rotary
from megalite.parallel.contexts import Contexts
from megalite.parallel.init import init_parameters_
from megalite.model.head import LMHead
from megalite.parallel.mappings import all_gather
from megalite.parallel.random import TensorParallelRNG
from megalite.parallel.state import ParallelState
from megalite.parallel.vocab import VocabParallelEmbedding
from megalite.pipeline.stages import chunks_of


class Output:
    """What a forward returns.

    logits: [batch, seq, padded_vocab / tp], this rank's vocab columns (padding at -inf).
        Computed when first read, from the weights as they are then, so a training step that
        only wants the loss never makes them (with TP, every rank must read them: the head's
        input is gathered under sequence parallelism).
    token_losses: [batch, seq], 0 where labels == -100 (None without labels); differentiable
        unless a loss_scale was given.
    loss: with loss_scale, sum(token_losses) * loss_scale, differentiable.
    hidden: a model chunk's output for the next pipeline stage (and nothing else then).
    """

    def __init__(self, make_logits: Callable[[], torch.Tensor] | None = None,
                 token_losses: torch.Tensor | None = None, loss: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None):
        self._make_logits = make_logits
        self.token_losses, self.loss, self.hidden = token_losses, loss, hidden

    @cached_property
    def logits(self) -> torch.Tensor:
        if self._make_logits is None:
            raise ValueError("this model chunk does not end the model: only the last pipeline "
                             "stage's output has logits")
        return self._make_logits()


ATTENTIONS = {"gqa": Attention, "mla": LatentAttention}  # model.attention.kind -> the part


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: Contexts, rng: TensorParallelRNG, layer: int):
        super().__init__()
        tp = parallel.tp
        self.attn_norm = Norm(cfg, tp)
        self.attn = ATTENTIONS[cfg.attention.kind](cfg, tp, parallel.cp, rng, layer)
        self.attn_post_norm = Norm(cfg, tp) if cfg.norms.post_norms else None
        self.mlp_norm = Norm(cfg, tp)
        self.mlp = MoE(cfg, tp, parallel.ep, rng) if cfg.is_moe_layer(layer) else MLP(cfg, tp)
        self.mlp_post_norm = Norm(cfg, tp) if cfg.norms.post_norms else None
        self.tp, self.rng, self.dropout = tp, rng, cfg.dropout

    def forward(self, x, inputs: RankInputs):
        """x: the residual stream, or this rank's sequence shard of it (tp.sharded)."""
        sp = self.tp.sharded
        h = self.attn(self.attn_norm(x), inputs)
        if self.attn_post_norm is not None:
            h = self.attn_post_norm(h)
        # Residual dropout: the same mask on every TP rank for the replicated stream, its own
        # mask on each rank's shard (rng.dropout).
        x = x + self.rng.dropout(h, self.dropout, self.training, split=sp)
        h = self.mlp_norm(x)
        h = self.mlp(h, inputs)
        if self.mlp_post_norm is not None:
            h = self.mlp_post_norm(h)
        return x + self.rng.dropout(h, self.dropout, self.training, split=sp)


class Layers(nn.ModuleDict):
    """This rank's blocks, named by global layer number; iterated in layer order."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, layer: int) -> Block:
        return super().__getitem__(str(layer))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, pstate: ParallelState, seed: int = 0, init: bool = True,
                 activation_checkpointing: bool = False, loss_chunk_tokens: int = 4096,
                 parallel: ParallelConfig | None = None):
        """init=False leaves the parameters unset, for a model whose every weight is loaded next
        (a checkpoint, Hugging Face weights): the TP-invariant init draws each full tensor on
        every rank, which is wasted there. activation_checkpointing: recompute each block's
        activations in backward instead of storing them (in training mode). loss_chunk_tokens:
        tokens per chunk of the fused head + loss, whose logits are chunk x padded_vocab / tp.
        parallel: the strategy on the mesh `pstate` (sequence parallelism, CP's K/V exchange,
        the pipeline's stages); its sizes are the mesh's."""
        super().__init__()
        self.cfg, self.pstate = cfg, pstate
        layout = parallel or ParallelConfig()
        self.chunks = chunks_of(cfg.n_layers, pstate.pp_size, pstate.pp_rank,
                                layout.virtual_stages, layout.pp_layers)
        parallel = Contexts.of(pstate, layout.sequence_parallel, layout.cp_comm, cfg.moe is not None)
        tp = self.tp = parallel.tp
        self.split = RankSplit(tp, parallel.cp, cfg.max_seq_len)
        self.rng = TensorParallelRNG(seed, pstate.pp_rank * pstate.tp_size + pstate.tp_rank, pstate.device)
        embeds, ends = any(c.is_first for c in self.chunks), any(c.is_last for c in self.chunks)
        with pstate.device:  # where the parts make their parameters and buffers
            self.embed = (VocabParallelEmbedding(cfg.padded_vocab, cfg.hidden, tp, init_std=cfg.init_std)
                          if embeds or (ends and cfg.tie_embeddings) else None)
            self.positions = (LearnedPositions(cfg.max_seq_len, cfg.hidden, tp, cfg.init_std)
                              if cfg.positions.kind == "learned" and embeds else None)
            self.rotary = Rotary(cfg) if cfg.positions.kind == "rotary" else None
            self.blocks = Layers({str(i): Block(cfg, parallel, self.rng, i)
                                  for chunk in self.chunks for i in chunk.layers})
            self.norm = Norm(cfg, tp) if ends else None
            self.head = (LMHead(cfg, tp, self.embed if cfg.tie_embeddings else None,
                                loss_chunk_tokens) if ends else None)
        if self.embed is not None and not embeds:
            self.embed.weight.pipeline_copy = True  # the first stage's counts in norms and saves
        self.activation_checkpointing = activation_checkpointing
        if init:
            init_parameters_(self, seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                cache: KVCache | None = None, loss_scale: torch.Tensor | float | None = None,
                chunk: int = 0, hidden: torch.Tensor | None = None) -> Output:
        """The batch's rows (laid out for this rank by model/inputs.py). cache: decode
        incrementally. loss_scale (with labels): also return loss = sum(token_losses) *
        loss_scale, whose gradients the head + loss make in forward (training: 1 / the global
        batch's token count); token_losses are then not differentiable.

        Pipelined: run this rank's model chunk `chunk`; `hidden` is the previous stage's output
        (unless the chunk embeds), and the Output has only `hidden` unless the chunk ends the
        model."""
        stage, inputs = self.chunks[chunk], self.split.inputs(input_ids, attention_mask, doc_ids,
                                                                labels, cache)
        inputs.loss_scale = loss_scale
        inputs.rotary = self.rotary(inputs.layout.positions) if self.rotary is not None else None
        with self.tp.splitting(inputs.sp):
            x = self._embed(inputs) if stage.is_first else hidden
            for block in (self.blocks[i] for i in stage.layers):
                if self.activation_checkpointing and self.training:
                    x = checkpoint(self._in_layout, block, x, inputs, use_reentrant=False,
                                   context_fn=self.rng.recompute_contexts)
                else:
                    x = block(x, inputs)
            if cache is not None and chunk == len(self.chunks) - 1:
                cache.offset += inputs.seq  # every chunk of this rank has written at the same offset
            if not stage.is_last:
                return Output(hidden=x)
            x = self.norm(x)
            losses = () if labels is None else self.head(x, inputs.labels, inputs.seq, loss_scale)
        return Output(partial(self._logits, x, inputs), *losses)

    def _in_layout(self, block: Block, x: torch.Tensor, inputs: RankInputs) -> torch.Tensor:
        """block(x, inputs) in this call's layout: recomputed in backward, outside the forward."""
        with self.tp.splitting(inputs.sp):
            return block(x, inputs)

    def _logits(self, x: torch.Tensor, inputs: RankInputs) -> torch.Tensor:
        with self.tp.splitting(inputs.sp):  # read after the forward: its layout again
            return self.head.logits(x, inputs.seq)

    def _embed(self, inputs: RankInputs) -> torch.Tensor:
        x = self.embed(inputs.ids)
        if self.cfg.scale_embeddings:  # Gemma: in the embeddings' dtype, as transformers does
            x = x * torch.tensor(self.cfg.hidden ** 0.5, dtype=x.dtype)
        if self.positions is not None:
            x = x + self.positions(inputs.layout.positions)
        return self.rng.dropout(x, self.cfg.dropout, self.training, split=self.tp.sharded)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """dtype: the keys' and values' (default: the parameters', as the projections make them)."""
        shapes = {int(i): block.attn.cache_shapes(batch, max_len) for i, block in self.blocks.items()}
        dtype = dtype or next(next(iter(self.blocks)).attn.parameters()).dtype
        return KVCache(shapes, self.pstate.device, dtype)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All vocab columns of `logits` (a collective over TP), the padding stripped."""
        if self.tp.size > 1:
            logits = all_gather(logits, -1, self.tp.group)
        return logits[..., : self.cfg.vocab_size]

