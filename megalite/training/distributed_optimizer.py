"""The distributed optimizer (train.zero_stage=1, Megatron's --use-distributed-optimizer, ZeRO-1):
each replica of a parameter keeps the fp32 weight and the optimizer state of its rows only.

The replicas of a TP slice are the ranks of the gradient group (CP x DP, `pstate.grad_group`);
member k holds rows `row_range(rows, k, grad_size)` of each parameter's local tensor (the
contract with checkpoints: `held_rows`, `master`, `optimizer_state`). What crosses which group:

  backward  each micro-batch's gradient accumulates locally, whole (fp32; pure_bf16's bf16
            gradients into an fp32 sum). On the last micro-batch, as backward finishes a bucket
            (grads.bucket_params' order), its gradients are copied rank-major into one buffer
            (region k: rank k's rows of each parameter, regions padded to one size) and
            reduce-scattered over the gradient group, overlapped with the rest of backward:
            each rank receives the sum of its rows. The whole gradients are then freed.
  step      tied embeddings: the two pipeline copies' rows are summed over the embedding group;
            the norm's sums of squares of the rows over the gradient group, then TP and PP
            (grads.clip_grad_norm_); the optimizer updates the rows; each bucket's updated rows are
            all-gathered over the gradient group into the parameters, in their dtype (pure_bf16:
            each row rounded to bf16 once, as the replicated engine rounds its whole masters).
  forward   nothing: the parameters are whole again (the all-gathers end the step, they do not
            overlap the next forward).

AdamW is element-wise, so updating rows with their summed gradients and the global clipping
coefficient is the replicated update of those rows. Muon's momentum is element-wise too; its
orthogonalisation all-gathers the rows of each matrix's update over the replica group (and the
TP slices), runs on the whole matrix, and keeps the rows (optimizers/matrices.py).
"""
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from megalite.config import ParallelConfig
from megalite.parallel.sharding import row_range
from megalite.parallel.state import ParallelState
from megalite.run_config import TrainConfig
from megalite.training.engine import NativeEngine
from megalite.training.grads import DataParallelGradSync, replica_group, replica_rank
from megalite.training.mixed_precision import MasterWeights, copy_marks
from megalite.training.optimizers.build import build_optimizer
from megalite.training.optimizers.matrices import layout_of

# torch 2.13 renames these two (…_single); the old names work in every supported torch and are
# the ones bench/comm.py's CommLog counts.
warnings.filterwarnings("ignore", category=FutureWarning,
                        message=r".*(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")


class ShardedBucket:
    """Parameters whose gradients one reduce-scatter sums by rows and whose updated rows one
    all-gather brings back. Driven by grads.DataParallelGradSync, as a `Bucket`.

    Both collectives' buffers are rank-major: region k holds rank k's rows of each parameter in
    turn, then padding up to `region` elements, the largest share."""

    def __init__(self, params: list[nn.Parameter], shards: dict[int, nn.Parameter],
                 rank: int, size: int):
        self.params, self.rank, self.size = params, rank, size
        self.shards = [shards[id(p)] for p in params]  # whose .grad takes this rank's sums
        # counts[k][i]: elements of params[i] that rank k holds (its rows of it)
        self.counts = [[p.shape[1:].numel() * len(range(*row_range(p.shape[0], k, size))) for p in params]
                       for k in range(size)]
        self.region = max(sum(c) for c in self.counts)
        self.pieces = [[*c, self.region - sum(c)] for c in self.counts]  # a region's split
        self.sums: list[torch.Tensor | None] = [None] * len(params)  # bf16 parameters' fp32 sums

    def adopt(self, index: int) -> None:
        """A bf16 parameter's gradient is added into its fp32 sum and freed (an fp32 one
        accumulates in p.grad)."""
        p = self.params[index]
        if p.grad is not None and p.dtype != torch.float32:
            total = self.sums[index]
            self.sums[index] = p.grad.float() if total is None else total.add_(p.grad)
            p.grad = None

    def _pairs(self, buffer: torch.Tensor, flats: list) -> tuple[list, list]:
        """For each rank k and each flats[i] given (a flat tensor of params[i]'s numel, or None):
        rank k's region's part for params[i] in the rank-major `buffer`, and rank k's rows of
        flats[i]; what one foreach copy moves, either way."""
        regions = [row.split(pieces)[:-1] for row, pieces in zip(buffer.view(self.size, -1), self.pieces)]
        parts, rows = [], []
        for i, flat in enumerate(flats):
            if flat is not None:
                parts += [region[i] for region in regions]
                rows += flat.split([c[i] for c in self.counts])
        return parts, rows

    def start(self, group, reduce_dtype: torch.dtype | None) -> Callable[[], None]:
        """Start the reduce-scatter of the accumulated gradients (a missing one counts as zeros)
        and free them; the returned call waits and sets each shard's .grad (fp32) to its sum."""
        dtype = reduce_dtype or torch.float32
        device = self.params[0].device
        send = torch.zeros(self.size * self.region, dtype=dtype, device=device)
        grads = [p.grad if p.dtype == torch.float32 else total for p, total in zip(self.params, self.sums)]
        parts, rows = self._pairs(send, [None if g is None else g.reshape(-1) for g in grads])
        if parts:
            torch._foreach_copy_(parts, rows)
        for p in self.params:
            p.grad = None
        self.sums = [None] * len(self.params)
        recv = torch.empty(self.region, dtype=dtype, device=device)
        work = dist.reduce_scatter_tensor(recv, send, group=group, async_op=True)

        def finish(send=send) -> None:  # the input lives until the reduce-scatter is done
            work.wait()
            mine = recv.float().split(self.pieces[self.rank])  # recv itself when it is fp32
            for shard, grad in zip(self.shards, mine):
                shard.grad = grad.view(shard.shape)
        return finish

    @torch.no_grad()
    def gather(self, group) -> Callable[[], None]:
        """Start the all-gather of every rank's updated rows; the returned call waits and copies
        them into the parameters (cast to their dtype)."""
        dtype, device = self.params[0].dtype, self.params[0].device
        send = torch.zeros(self.region, dtype=dtype, device=device)
        torch._foreach_copy_(list(send.split(self.pieces[self.rank])[:-1]),
                             [s.detach().reshape(-1) for s in self.shards])
        recv = torch.empty(self.size * self.region, dtype=dtype, device=device)
        work = dist.all_gather_into_tensor(recv, send, group=group, async_op=True)

        def finish(send=send) -> None:
            work.wait()
            parts, rows = self._pairs(recv, [p.detach().view(-1) for p in self.params])
            torch._foreach_copy_(rows, parts)
        return finish


class DistributedOptimizer(NativeEngine):
    """The native engine with train.zero_stage=1 (build_engine picks it when the gradient group
    has more than one rank): the optimizer steps this rank's rows of each parameter, a leaf
    tensor per parameter (`master(p)`): a view of p's rows (fp32), or the fp32 master rows
    (pure_bf16), whose .grad is the reduce-scattered sum of those rows."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, pstate: ParallelState,
                 parallel: ParallelConfig = ParallelConfig()):
        self.model = self.module = model
        self.cfg, self.pstate = cfg, pstate
        params = list(model.parameters())
        self.rows = {id(p): row_range(p.shape[0], *replica_rank(p, pstate)) for p in params}
        if cfg.precision == "pure_bf16":
            self.masters = MasterWeights(model, rows=self.held_rows)  # casts the model to bf16
            shards = [self.masters.master(p) for p in params]
        else:
            self.masters = None
            # Experts with no replica (ep = CP x DP) are whole here, outside the buckets: the
            # optimizer steps the parameter itself, which backward fills.
            shards = [_rows_of(p, *self.held_rows(p)) if replica_rank(p, pstate)[1] > 1 else p
                      for p in params]
        self.shard = {id(p): s for p, s in zip(params, shards)}
        # What the optimizer steps and the clipping scales: the rows. Decay groups by dim, which
        # rows of a tensor share with it; Muon gathers the rows of its matrices.
        self.trained = nn.ParameterList(shards)
        self.optimizer = build_optimizer(
            model, cfg, pstate, self.master,
            layout=lambda p: layout_of(p, pstate, self.held_rows(p),
                                       (replica_group(p, pstate), *replica_rank(p, pstate))))
        # Buckets of dp_bucket_mb of fp32 gradient, whatever the parameters' dtype.
        bucket_mb = parallel.dp_bucket_mb * params[0].element_size() / 4
        self.grad_sync = DataParallelGradSync(
            model, pstate, bucket_mb, parallel.dp_reduce_dtype,
            make_bucket=lambda bucket: ShardedBucket(bucket, self.shard,
                                                     *replica_rank(bucket[0], pstate)))

    def held_rows(self, p: nn.Parameter) -> tuple[int, int]:
        return self.rows[id(p)]

    def master(self, p: nn.Parameter) -> nn.Parameter:
        return self.shard[id(p)]

    rows_sharded = True

    def update_model(self) -> None:
        """Every rank's stepped rows, all-gathered into the parameters. Two buckets in flight at
        most: each gather's buffer holds its bucket's whole parameters."""
        in_flight: list = []
        for bucket, group in zip(self.grad_sync.buckets, self.grad_sync.groups):
            in_flight.append(bucket.gather(group))
            if len(in_flight) > 2:
                in_flight.pop(0)()
        for finish in in_flight:
            finish()


def _rows_of(p: nn.Parameter, start: int, stop: int) -> nn.Parameter:
    """A leaf parameter viewing rows [start, stop) of p (updating it updates p), with p's marks."""
    return copy_marks(nn.Parameter(p.detach()[start:stop], requires_grad=p.requires_grad), p)
