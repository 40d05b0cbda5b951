"""Ring attention (parallel.cp_comm=p2p): K/V blocks pass around the CP ring.

Each rank's queries attend its own K/V block first, then the block of the rank before it, and so
on (cp steps, the next block in flight while this one is computed); each step's partial
result is merged into the running one by log-sum-exp (online softmax, Milakov & Gimelshein
2018; Liu et al. 2023). Backward recomputes each block's probabilities from the final
log-sum-exp and passes each K/V block around the ring again, its dK/dV accumulator a step
behind, which a last send brings home.

Zig-zag shares (context.py) make two of the four chunk pairs of a foreign block entirely
masked under causality: a block from an earlier rank is seen only through its first chunk
(by all local queries), one from a later rank only by the local second chunk. The other
halves are skipped. The dense mask rows of the layout (padding, documents) apply within what
is computed. Math kernels in fp32 here (exact on CPU); a fused kernel returning the
log-sum-exp would serve GPUs (not yet done: docs/parallelism.md).
"""
import math

import torch
import torch.distributed as dist

from megalite.parallel.context import zigzag_index
from megalite.parallel.p2p import Message, PipeComm

KV_TAG, GRAD_TAG = 71, 72


class Ring:
    """A rank's neighbours on the CP ring, as global ranks, and the P2P messages between them."""

    def __init__(self, group, device: torch.device):
        ranks = dist.get_process_group_ranks(group)
        self.cp, self.rank = len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.cp], ranks[(self.rank - 1) % self.cp]
        self.comm = PipeComm(device, process_group=group)

    def pass_on(self, tensor: torch.Tensor, tag: int):
        """Send `tensor` to the next rank, receive the previous rank's (a handle to wait on)."""
        return self.comm.exchange([Message(self.next, tag, tensor=tensor)],
                                  [Message(self.prev, tag, shape=tensor.shape, dtype=tensor.dtype)])[0]


def _block(ring: Ring, step: int, local: int) -> tuple[int, slice, slice]:
    """(source rank, local query slice, key slice of the block) computed at ring step `step`."""
    src = (ring.rank - step) % ring.cp
    half = local // 2
    if step == 0:
        return src, slice(0, local), slice(0, local)
    if src < ring.rank:
        return src, slice(0, local), slice(0, half)  # its first chunk, before both of ours
    return src, slice(half, local), slice(0, local)  # after our first chunk: our second sees it


def _per_query_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V [b, kv_heads, n, d] repeated for each of its GQA group's query heads."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _ring_blocks(ring: Ring, q, k, v, mask, seq: int, scale: float):
    """What each ring step computes, this rank's own K/V block first, then the rank before's,
    and so on, the next block in flight while the caller works on this one: the step's query
    slice, its key slice, the block's K and V there in fp32, and the [b, h, nq, nk] fp32
    scores, -inf where masked. Once the caller is done with the last block, every send of the
    pass (also the caller's) has left."""
    kv = torch.cat((k, v), dim=1)
    for step in range(ring.cp):
        incoming = ring.pass_on(kv, KV_TAG) if step < ring.cp - 1 else None
        src, qs, ks = _block(ring, step, q.shape[2])
        cols = zigzag_index(seq, ring.cp, src, q.device)[ks]
        bk, bv = (t[:, :, ks].float() for t in kv.chunk(2, dim=1))
        scores = q[:, :, qs].float() @ _per_query_head(bk, q.shape[1]).transpose(-1, -2) * scale
        yield qs, ks, bk, bv, scores.masked_fill(~mask[:, :, qs][..., cols], float("-inf"))
        if incoming is not None:
            kv = incoming.wait()
    ring.comm.finish()


def _group_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, h, n, d] summed over each KV head's query heads: [b, kv_heads, n, d]."""
    b, h, n, d = x.shape
    return x.view(b, kv_heads, h // kv_heads, n, d).sum(2)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, ring: Ring, seq: int, scale: float):
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for qs, _, _, bv, s in _ring_blocks(ring, q, k, v, mask, seq, scale):
            block_lse = torch.logsumexp(s, dim=-1)
            merged = torch.logaddexp(lse[:, :, qs], block_lse)
            # Each query sees itself at step 0, so `merged` is finite from then on.
            p = torch.exp(s - merged.unsqueeze(-1))
            out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[:, :, qs] - merged).unsqueeze(-1)
                             + p @ _per_query_head(bv, q.shape[1]))
            lse[:, :, qs] = merged
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.ring, ctx.seq, ctx.scale = ring, seq, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        ring, seq = ctx.ring, ctx.seq
        scale, heads, kv_heads = ctx.scale, q.shape[1], k.shape[1]
        dout = dout.float()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # K/V go round as in forward, the next block in flight during this one's work. Each
        # block's dK/dV accumulator follows it a step behind: sent on once this rank has added
        # its share, received while the next block is computed, and home after the last step.
        dkv = None
        for qs, ks, bk, bv, s in _ring_blocks(ring, q, k, v, mask, seq, scale):
            p = torch.exp(s - lse[:, :, qs].unsqueeze(-1))
            do = dout[:, :, qs]
            share = q.new_zeros((k.shape[0], 2 * kv_heads, *k.shape[2:]), dtype=torch.float32)
            dk, dv = share.chunk(2, dim=1)
            dv[:, :, ks] = _group_sum(p.transpose(-1, -2) @ do, kv_heads)
            dp = do @ _per_query_head(bv, heads).transpose(-1, -2)
            ds = p * (dp - delta[:, :, qs]) * scale
            dq[:, :, qs] += ds @ _per_query_head(bk, heads)
            dk[:, :, ks] = _group_sum(ds.transpose(-1, -2) @ q[:, :, qs].float(), kv_heads)
            # The block's accumulator from the rank that held it last step (none at step 0:
            # the block is this rank's own).
            dkv = share if dkv is None else dkv.wait() + share
            dkv = ring.pass_on(dkv, GRAD_TAG)
        dk, dv = dkv.wait().chunk(2, dim=1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   ring: Ring, scale: float | None = None) -> torch.Tensor:
    """Softmax attention of this rank's queries [b, h, local, d] over the whole row's keys,
    whose blocks (this rank's k, v: [b, kv_heads, local, d]) pass around the ring. mask:
    [b or 1, 1, local, seq], the layout's rows of these queries against every key. scale: of
    the scores (None: 1 / sqrt(d))."""
    # The merge's math is fp32 by design: autocast would run its matmuls in bf16 (backward,
    # outside autocast, would then recompute probabilities that forward did not use).
    with torch.autocast(q.device.type, enabled=False):
        return RingAttention.apply(q, k, v, mask, ring, mask.shape[-1],
                                   1 / math.sqrt(q.shape[-1]) if scale is None else scale)
