"""The data-parallel engine: how gradients cross DP ranks and how the optimizer steps.

`train.engine` picks one (build.py); the training loop sees only these calls, in this order per step:

    engine.set_lr(lr)
    engine.module(...)                      the model's forward, once per micro-batch
    engine.backward(micro_loss, last=...)   in the schedule's order (pipeline/runner.py)
    grad_norm = engine.step()               clip, update, zero the gradients

native (the default): train.optimizer's optimizers and the TP-aware clipping of grads.py. With
train.zero_stage=1 (the default) and more than one replica of each parameter (CP x DP > 1),
the distributed optimizer (distributed_optimizer.py): each replica holds the fp32 weight and
optimizer state of its rows of each parameter, gradients are reduce-scattered and the updated rows
all-gathered; with zero_stage=0, or a single replica, NativeEngine: replicated state, gradients
all-reduced in buckets overlapped with backward. deepspeed: DeepSpeed ZeRO stage 0, 1 or 2
(deepspeed_engine.py). Every engine tells which rows of a parameter's local tensor it holds
(`held_rows`) and reads and sets their weight and optimizer state by name (`master`,
`states`, `optimizer_state`, `load_optimizer_state`), so checkpoints stay layout-,
engine- and optimizer-independent. Which optimizer steps (AdamW, Muon, Adafactor) is
training/optimizers/, and each says how its state is split (chained.ROWS, MATRICES).

train.precision=pure_bf16 (native only): the engine keeps fp32 masters of the then bf16 model
(mixed_precision.py); `master(p)` is the fp32 weight a checkpoint saves for model parameter p.
"""
from contextlib import nullcontext
from typing import Iterable

import torch

from megalite.config import ParallelConfig
from megalite.parallel.state import ParallelState
from megalite.run_config import TrainConfig
from megalite.pipeline.objective import LanguageModel
from megalite.pipeline.runner import train_pipelined
from megalite.model.moe import update_expert_bias
from megalite.training.grads import DataParallelGradSync, clip_grad_norm_, sum_embedding_copies
from megalite.training.mixed_precision import MasterWeights
from megalite.training.optimizers.build import build_optimizer
from megalite.training.optimizers.chained import ChainedOptimizer


class EngineBase:
    """What every engine shares: its optimizer (`self.optimizer`, set by the subclass: a
    ChainedOptimizer, or DeepSpeed's wrapper of one AdamW), the learning rate, and the
    optimizer's per-parameter state read and set by name for each model parameter."""

    optimizer: ChainedOptimizer

    def master(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        """The tensor the optimizer steps for model parameter p (and its full-precision weight),
        rows `held_rows(p)`: p itself, but for pure_bf16's fp32 master."""
        return p

    def held_rows(self, p: torch.nn.Parameter) -> tuple[int, int]:
        """Rows [start, stop) of p's local tensor (this rank's TP slice) whose fp32 weight
        (`master`) and optimizer state (`optimizer_state`) this rank holds: all of them, but for
        a distributed optimizer."""
        return 0, p.shape[0]

    def set_lr(self, lr: float) -> None:
        """The schedule's rate: train.lr's groups take it, Muon's it times muon.lr / lr."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)

    def states(self, p: torch.nn.Parameter) -> dict[str, str]:
        """The per-parameter state p's optimizer keeps (AdamW's moments, Muon's momentum,
        Adafactor's factors), by name, with its split (optimizers/chained.py)."""
        return self.optimizer.states(self.master(p))

    def optimizer_state(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """p's optimizer state by name, as `states(p)` splits it: ROWS, rows `held_rows(p)` of
        this rank's TP slice (none before the first step)."""
        return self.optimizer.state_of(self.master(p))

    def load_optimizer_state(self, pairs: Iterable[tuple[torch.nn.Parameter, dict]],
                             step: int) -> None:
        """Set the optimizer state from (parameter, {name: rows `held_rows(p)` of this rank's
        TP slice}) pairs, `step` steps in."""
        self.optimizer.load_state(((self.master(p), tensors) for p, tensors in pairs), step)


class NativeEngine(EngineBase):
    """Replicated optimizer state, gradients all-reduced over CP x DP (train.zero_stage=0, or
    one replica). build_engine picks the distributed optimizer for zero_stage=1; constructed
    directly, this class is the replicated engine whatever cfg.zero_stage says."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, pstate: ParallelState,
                 parallel: ParallelConfig = ParallelConfig()):
        self.model = self.module = model
        self.cfg, self.pstate = cfg, pstate
        # Built after the weights are loaded (train.py), so the masters take the checkpoint's
        # fp32 values, not their bf16 rounding.
        self.masters = MasterWeights(model) if cfg.precision == "pure_bf16" else None
        # What the optimizer steps, the DP sync sums and the clipping scales.
        self.trained = model if self.masters is None else self.masters
        self.optimizer = build_optimizer(model, cfg, pstate, self.master)
        self.grad_sync = DataParallelGradSync(self.trained, pstate, parallel.dp_bucket_mb,
                                              parallel.dp_reduce_dtype,
                                              hooks=self.masters is None)
        if self.masters is not None:
            self.masters.accumulate_grads(then=self.grad_sync.grad_ready)

    def master(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        return p if self.masters is None else self.masters.master(p)

    def backward(self, loss: torch.Tensor, last: bool, grad: torch.Tensor | None = None) -> None:
        """grad: the gradient of `loss` when it is a pipeline stage's output, not the loss."""
        with self.grad_sync.last_micro_batch() if last else nullcontext():
            torch.autograd.backward(loss, grad)

    rows_sharded = False  # the optimizer steps this rank's rows of each parameter

    def step(self) -> torch.Tensor:
        self.grad_sync.wait()
        # The two copies hold the same rows: summing the rows sums the copies.
        sum_embedding_copies(self.model, self.master, self.pstate)
        norm = clip_grad_norm_(self.trained, self.cfg.grad_clip, self.pstate,
                               rows_sharded=self.rows_sharded)
        self.optimizer.step()
        # Replicated masters' gradients are kept fp32 buffers (the DP buckets' slots): zeroed in
        # place; the rows' are the reduce-scatters' outputs.
        self.optimizer.zero_grad(set_to_none=self.masters is None or self.rows_sharded)
        self.update_model()
        return norm

    def update_model(self) -> None:
        """The stepped weights into the model."""
        if self.masters is not None:
            self.masters.copy_to_model()


def autocast_for(device: torch.device, precision: str):
    """bf16 autocast for precision=bf16, or auto on a GPU; otherwise no context: fp32, or
    pure_bf16, whose parameters are bf16 already."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def train_step(engine, batches: list, n_tokens: torch.Tensor, autocast,
               pp_schedule: str = "1f1b", objective=LanguageModel()) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over this DP rank's micro-batches: (loss, gradient norm).

    The loss is the objective's mean over the GLOBAL batch (the language model's: over every
    real target token, `n_tokens`, all micro-batches of all DP ranks): each micro-batch's loss
    sum is divided by that count, so the sum over micro-batches and DP ranks is the same number
    for any layout. The returned loss is this rank's part of it (zero off the last pipeline stage).
    """
    # One stage runs every schedule in 1F1B's order: each backward right after its forward.
    schedule = pp_schedule if engine.pstate.pp_size > 1 else "1f1b"
    loss = train_pipelined(engine, batches, n_tokens, autocast, schedule, objective)
    norm = engine.step()
    update_expert_bias(engine.model, engine.pstate.dp_group)
    return loss, norm
