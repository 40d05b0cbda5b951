"""Gradients across ranks: DP all-reduce in buckets overlapped with backward, and the global norm.

DP: every DP rank holds the same parameters and the loss is normalised by the GLOBAL token
count, so the right gradient is the SUM over DP ranks. Small collectives are latency-bound, so
gradients are reduced in buckets (PyTorch DDP's scheme): each bucket is one flat buffer and each
p.grad a view of its slot, so the reduced sum lands in p.grad with no copy out. On the last
micro-batch a bucket's all-reduce starts as soon as backward has accumulated all its gradients,
while backward carries on with earlier layers. (The distributed optimizer, train.zero_stage=1,
reduce-scatters the same buckets by rows instead: distributed_optimizer.py.)

Norm: TP slices of one weight are disjoint parts of it, so their squared norms add up over
the TP group; replicated parameters are identical on every TP rank and count once; a slice
held by c copies (GQA's KV heads) counts 1/c per copy.
"""
from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist

from megalite.parallel.mappings import all_reduce_over, group_size
from megalite.parallel.sharding import expert_shard_of, shard_of
from megalite.parallel.state import ParallelState

MIB = 1024 * 1024


def bucket_params(params: list[torch.nn.Parameter], cap_bytes: float) -> list[list]:
    """Group params into buckets in the order backward produces their gradients (the reverse of
    definition order, as DDP assumes): a bucket holds one dtype and one kind (experts' or the
    rest: they are summed over different groups) and takes parameters until the next would pass
    cap_bytes; a parameter larger than the cap has a bucket to itself."""
    buckets: list[list] = []
    filling: dict[tuple, tuple[list, int]] = {}
    for p in reversed(params):
        kind = (p.dtype, is_expert(p))
        bucket, used = filling.get(kind, (None, 0))
        size = p.numel() * p.element_size()
        if bucket is None or used + size > cap_bytes:
            bucket, used = [], 0
            buckets.append(bucket)
        bucket.append(p)
        filling[kind] = (bucket, used + size)
    return buckets


def is_expert(p: torch.Tensor) -> bool:
    return expert_shard_of(p) is not None


def replica_group(p: torch.Tensor, pstate: ParallelState):
    """The ranks holding replicas of p, over which its gradient is summed: CP x DP, or for an
    MoE expert the ranks of CP x DP that hold the same experts."""
    return pstate.expert_grad_group if is_expert(p) else pstate.grad_group


def replica_rank(p: torch.Tensor, pstate: ParallelState) -> tuple[int, int]:
    """This rank's index in replica_group(p), and the group's size (the expert group lists
    every ep-th rank of the gradient group)."""
    if is_expert(p):
        return pstate.grad_rank // pstate.ep_size, pstate.grad_size // pstate.ep_size
    return pstate.grad_rank, pstate.grad_size


class Bucket:
    """Parameters whose gradients one all-reduce sums: a flat buffer and a param-shaped view of
    it per parameter.

    The interface DataParallelGradSync drives (the distributed optimizer's buckets share it):
    `params`, `adopt(index)` after each micro-batch's gradient of a parameter,
    and `start(group, reduce_dtype)`, which returns the call that finishes the reduction."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)
        parts = self.buffer.split([p.numel() for p in params])
        self.slots = [part.view_as(p) for part, p in zip(parts, params)]

    def adopt(self, index: int) -> None:
        """Make the gradient of params[index] its slot (zeros if it has none): accumulation then
        adds into the bucket in place."""
        p, slot = self.params[index], self.slots[index]
        if p.grad is None:
            slot.zero_()
        elif p.grad.data_ptr() != slot.data_ptr():  # new since zero_grad(set_to_none=True)
            slot.copy_(p.grad)
        p.grad = slot

    def start(self, group, reduce_dtype: torch.dtype | None) -> Callable[[], None]:
        """Start the all-reduce; the returned call waits for it and leaves the sums in p.grad."""
        payload = self.buffer if reduce_dtype is None else self.buffer.to(reduce_dtype)
        work = dist.all_reduce(payload, group=group, async_op=True)

        def finish() -> None:
            work.wait()
            if payload is not self.buffer:
                self.buffer.copy_(payload)
        return finish


class DataParallelGradSync:
    """Sums gradients over the DP group (with context parallelism, CP x DP): bucket by bucket, from backward's hooks on the last
    micro-batch; `wait` finishes the step's reduction.

    hooks=False: backward does not fill these gradients (pure_bf16's fp32 masters), so the
    caller calls `grad_ready(p)` once it has accumulated each p.grad. make_bucket: how a bucket
    of parameters is reduced (`Bucket`: all-reduced in place; the distributed optimizer's:
    reduce-scattered by rows).
    """

    def __init__(self, model: torch.nn.Module, pstate: ParallelState, bucket_mb: float = 25.0,
                 reduce_dtype: str = "fp32", hooks: bool = True,
                 make_bucket: Callable[[list], Bucket] = Bucket):
        self.reduce_dtype = {"fp32": None, "bf16": torch.bfloat16}[reduce_dtype]  # None: the gradients' own
        self.active = False
        params = [p for p in model.parameters()
                  if p.requires_grad and group_size(replica_group(p, pstate)) > 1]
        grouped = bucket_params(params, bucket_mb * MIB)
        self.buckets = [make_bucket(bucket) for bucket in grouped]
        self.groups = [replica_group(bucket[0], pstate) for bucket in grouped]  # each one's replicas
        self.slot_of = {id(p): (b, index) for b, bucket in enumerate(self.buckets)
                        for index, p in enumerate(bucket.params)}
        self._reset()
        if hooks:
            for p in params:
                p.register_post_accumulate_grad_hook(self.grad_ready)

    def grad_ready(self, p: torch.Tensor) -> None:
        """p.grad holds this micro-batch's gradient: make it p's slot, and on the last
        micro-batch start the buckets that are now full."""
        if id(p) not in self.slot_of:  # DP=1: nothing to reduce
            return
        b, index = self.slot_of[id(p)]
        self.buckets[b].adopt(index)
        if self.active:
            self.waiting[b].discard(index)
            # In bucket order, not in the order they fill: every rank must issue the same
            # all-reduces in the same order.
            while self.started < len(self.buckets) and not self.waiting[self.started]:
                self._start(self.buckets[self.started])

    def _start(self, bucket: Bucket) -> None:
        """Start the next bucket (in bucket order, every rank alike)."""
        self.pending.append(bucket.start(self.groups[self.started], self.reduce_dtype))
        self.started += 1

    @contextmanager
    def last_micro_batch(self):
        """Gradients accumulate locally until the backward inside this context reduces them."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def wait(self) -> None:
        """Leave every p.grad holding the DP sum of its gradient.

        Buckets backward did not fill (a parameter without a gradient on the last micro-batch)
        start here, in order, on every rank alike; a missing gradient counts as zeros, so a
        parameter that no rank used ends with a zero gradient, never one rank's None.
        """
        for bucket in self.buckets[self.started:]:
            for index in range(len(bucket.params)):
                bucket.adopt(index)
            self._start(bucket)
        for finish in self.pending:
            finish()
        self._reset()

    def _reset(self) -> None:
        """No bucket started: each waits for all its parameters' last gradients."""
        self.started, self.pending = 0, []
        self.waiting = [set(range(len(bucket.params))) for bucket in self.buckets]


def _sum_of_squares(grads: list, weights: list[float], device) -> torch.Tensor:
    """sum_i weights[i] * |grads[i]|^2 in fp32, by foreach kernels (no per-gradient copies)."""
    if not grads:
        return torch.zeros((), device=device, dtype=torch.float32)
    norms = torch._foreach_norm(grads, dtype=torch.float32)
    return torch.stack(torch._foreach_mul(torch._foreach_mul(norms, norms), weights)).sum()


def sum_embedding_copies(model: torch.nn.Module, master, pstate: ParallelState) -> None:
    """Tied embeddings over pipeline stages: the first stage's embedding and the last stage's
    copy (its LM head) each got part of the gradient; both take the sum, so they stay equal
    (Megatron's embedding group). `master(p)`: the tensor whose .grad the optimizer reads."""
    if pstate.embedding_group is not None and model.cfg.tie_embeddings and model.embed is not None:
        dist.all_reduce(master(model.embed.weight).grad, group=pstate.embedding_group)


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, pstate: ParallelState,
                    rows_sharded: bool = False) -> torch.Tensor:
    """Scale gradients so their global norm is at most max_norm (0: no clipping); return the norm.

    Pipeline stages hold disjoint parameters: their squares add up over the PP group, but for
    the last stage's copy of a tied embedding (`pipeline_copy`), which the first stage counts.
    MoE experts are disjoint over the EP group and whole on every TP rank. rows_sharded: `model`
    holds this rank's rows of each gradient (the distributed optimizer), disjoint over each
    parameter's replica group, where their squares add up first."""
    split, weights, replicated, experts, copies = [], [], [], [], []
    for p in model.parameters():
        if p.grad is None:
            continue
        shard = shard_of(p)
        if getattr(p, "pipeline_copy", False):
            copies.append(p.grad)  # clipped with the rest, counted by the first stage
        elif is_expert(p) and pstate.ep_size > 1:
            experts.append(p.grad)
        elif shard is None:  # experts at ep=1 too: whole on every rank, like any replicated one
            replicated.append(p.grad)
        else:
            split.append(p.grad)
            weights.append(shard.count / pstate.tp_size)
    split_squares = _sum_of_squares(split, weights, pstate.device)
    replicated_squares = _sum_of_squares(replicated, [1.0] * len(replicated), pstate.device)
    if rows_sharded:
        both = torch.stack([split_squares, replicated_squares])
        split_squares, replicated_squares = all_reduce_over(both, pstate.grad_group).unbind()
    all_reduce_over(split_squares, pstate.tp_group)
    total = split_squares + replicated_squares
    if pstate.ep_size > 1:
        expert_squares = _sum_of_squares(experts, [1.0] * len(experts), pstate.device)
        all_reduce_over(expert_squares, *((pstate.expert_grad_group,) if rows_sharded else ()),
                        pstate.ep_group)
        total = total + expert_squares
    norm = all_reduce_over(total, pstate.pp_group).sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(split + replicated + experts + copies, scale)
    return norm
