"""DeepSpeed ZeRO (stage 0, 1 or 2) as the data-parallel engine: `train.engine: deepspeed`.

`deepspeed.initialize` gets megalite's model, its AdamW and an `mpu` holding megalite's TP and DP
groups (the Megatron contract), so ZeRO partitions the optimizer state (stage 1) and the
gradients (stage 2) over the DP group only. Three things keep it the same training as the native
engine, to float rounding:

- The loss is already the mean over the GLOBAL batch's tokens, so the right gradient is the SUM
  over DP ranks and micro-batches: DeepSpeed is told to sum (`gradient_allreduce_op: sum`) and
  not to divide backward by the accumulation steps.
- TP-sharded parameters carry Megatron's `tensor_model_parallel = True`: DeepSpeed's gradient
  norm adds their squares on every TP rank and counts the replicated ones on TP rank 0 only.
  A slice held by several TP ranks (GQA with fewer KV heads than TP ranks) would be counted once
  per copy, so that layout is refused (check_deepspeed).
- Checkpoints keep megalite's format: AdamW's moments are read and written whole per parameter
  through ZeRO's parameter-to-partition map, so a run can resume on either engine.

How gradients cross DP (DeepSpeedEngine): ZeRO-2 without pipeline stages reduces them during
each backward, as they come; ZeRO-1, and ZeRO-2 with pipeline stages, run the step's backwards
in DeepSpeed's `coalesce_grad_reduction` block, which leaves them local until one reduction pass
at the step; stage 0 all-reduces at the step. With pipeline stages the `mpu`'s model-parallel
group is the TP x PP ranks of a DP replica and its tensor-parallel group the TP ranks, as in
DeepSpeed's PipelineParallelGrid; a stage's output is backpropagated as the scalar
sum(output * incoming gradient), whose gradient is the same; and the tied embedding's two copies
sum their gradients before the reduction pass (the last stage's is `ds_pipe_replicated`, so
ZeRO's norm counts it once).
"""
import importlib.util
from types import SimpleNamespace

import torch

from megalite.config import ModelConfig, ParallelConfig
from megalite.parallel.sharding import shard_of
from megalite.parallel.state import ParallelState
from megalite.run_config import TrainConfig
from megalite.training.engine import EngineBase
from megalite.training.grads import clip_grad_norm_, sum_embedding_copies
from megalite.training.optimizers.build import adamw
from megalite.training.optimizers.chained import ADAMW_STATE, load_state, state_by_name
from megalite.typed_config import ConfigError, failing

# Would change the arithmetic the parity with the native engine rests on. (DeepSpeed sees fp32
# weights, so ZeRO ignores data_types.grad_accum_dtype and stage 0 fails on any value but fp32,
# only once the processes are up.)
REFUSED = ("optimizer", "scheduler", "fp16", "bf16", "torch_autocast", "zero_optimization.stage",
           "data_types.grad_accum_dtype",
           # megalite reads and writes Adam's state on the device (checkpoints, resume)
           "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
           "zero_optimization.cpu_offload")


def model_parallel_unit(ps: ParallelState) -> SimpleNamespace:
    """megalite's layout under the names DeepSpeed asks Megatron's `mpu` for: tensor-parallel is
    the TP group; model-parallel is all model parallelism of a DP replica (TP x PP), which
    DeepSpeed sums gradient norms over."""
    model_group = ps.block_group(ps.tp_size * ps.pp_size)
    return SimpleNamespace(
        get_tensor_model_parallel_rank=lambda: ps.tp_rank,
        get_tensor_model_parallel_world_size=lambda: ps.tp_size,
        get_tensor_model_parallel_group=lambda: ps.tp_group,
        get_model_parallel_rank=lambda: ps.pp_rank * ps.tp_size + ps.tp_rank,
        get_model_parallel_world_size=lambda: ps.pp_size * ps.tp_size,
        get_model_parallel_group=lambda: model_group,
        get_data_parallel_rank=lambda: ps.dp_rank,
        get_data_parallel_world_size=lambda: ps.dp_size,
        get_data_parallel_group=lambda: ps.dp_group)


def deepspeed_problems(train: TrainConfig, model: ModelConfig, parallel: ParallelConfig,
                       world: int | None, installed: bool = True) -> list[str]:
    """Every way engine=deepspeed can be misconfigured, before any process group exists
    (installed: the deepspeed package too, where the run will import it)."""
    if train.engine != "deepspeed":
        return []
    tp, pp, n_kv = parallel.tp, parallel.pp, model.kv_heads
    problems = failing(
        (parallel.cp == 1, f"train.engine=deepspeed with parallel.cp={parallel.cp}: DeepSpeed's data-parallel "
                           f"group would not hold the context-parallel ranks, whose gradients must be "
                           f"summed too; use train.engine=native (or parallel.cp=1)"),
        (train.optimizer == "adamw",
         f"train.optimizer={train.optimizer} with train.engine=deepspeed: megalite hands DeepSpeed AdamW "
         f"only (ZeRO partitions state by flat element ranges, and {train.optimizer} needs whole matrices); "
         f"use train.engine=native for {train.optimizer} (train.zero_stage 0 or 1), or "
         f"train.optimizer=adamw"),
        (train.precision != "pure_bf16", "train.precision=pure_bf16 needs train.engine=native (megalite's "
                                         "fp32 masters live in its own engine): set train.engine=native, or "
                                         "use train.precision=bf16 with train.engine=deepspeed"),
        (pp == 1 or train.zero_stage != 0,
         f"train.zero_stage=0 with parallel.pp={pp}: stage 0 is plain data parallelism, which "
         f"train.engine=native does (DeepSpeed's stage-0 clipping would count the other stages' "
         f"replicated weights wrongly): use train.engine=native, or train.zero_stage=1"),
        (not installed or importlib.util.find_spec("deepspeed") is not None,
         "train.engine=deepspeed needs the deepspeed package: pip install "
         "--no-build-isolation 'megalite[deepspeed]' (after torch), or set train.engine=native"),
        (world is not None, "train.engine=deepspeed runs under torchrun (DeepSpeed needs a process "
                            "group): torchrun --nproc_per_node N -m megalite.train ..."),
        (n_kv >= tp, f"train.engine=deepspeed with model.attention.n_kv_heads={n_kv} < parallel.tp={tp}: "
                     f"each KV head would sit on {tp // max(n_kv, 1)} TP ranks and DeepSpeed's gradient "
                     f"norm would count it {tp // max(n_kv, 1)} times; use parallel.tp <= {n_kv} or "
                     f"train.engine=native"),
    )
    problems += [f"train.deepspeed.{key} is set by megalite (the optimizer is AdamW from train.*, "
                 f"the schedule is train.lr/warmup_steps, precision is train.precision, the stage "
                 f"is train.zero_stage; no offload): remove it"
                 for key in REFUSED if _lookup(train.deepspeed, key) is not None]
    whole = tp >= 1 and pp >= 1 and world and world % (tp * pp) == 0 and train.micro_batch_size >= 1
    if not problems and whole:  # (a layout or batch that does not divide: the plan says so)
        try:
            deepspeed_config(train, world // (tp * pp))
        except ConfigError as err:
            problems.append(str(err))
    return problems


def deepspeed_config(train: TrainConfig, dp: int) -> dict:
    # Set by megalite from train.*; a passthrough value for one of them must agree.
    derived = {"train_batch_size": train.global_batch_size,
               "train_micro_batch_size_per_gpu": train.micro_batch_size,
               "gradient_accumulation_steps": train.global_batch_size // (train.micro_batch_size * dp),
               "gradient_clipping": train.grad_clip,
               "gradient_allreduce_op": "sum"}
    for key, value in derived.items():
        given = train.deepspeed.get(key)
        if given is not None and given != value:
            raise ConfigError(f"train.deepspeed.{key}={given!r} disagrees with the value megalite "
                              f"derives from train.* ({value!r}): remove it")
    return {**derived, "steps_per_print": 2**31 - 1, **train.deepspeed,
            "zero_optimization": {**train.deepspeed.get("zero_optimization", {}),
                                  "stage": train.zero_stage}}


class DeepSpeedEngine(EngineBase):
    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, pstate: ParallelState):
        import deepspeed
        for p in model.parameters():
            # Split over TP: each rank's slice counts in the norm. A matrix every TP rank holds
            # whole (MLA's down-projections: shards=1) counts once, as replicated weights do.
            if shard_of(p) is not None and shard_of(p).count == pstate.tp_size:
                p.tensor_model_parallel = True
            if getattr(p, "pipeline_copy", False):
                p.ds_pipe_replicated = True  # ZeRO's norm counts the first stage's weight only
        deepspeed.init_distributed(dist_backend="nccl" if pstate.device.type == "cuda" else "gloo")
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=adamw(list(model.parameters()), cfg, pstate.device),
            mpu=model_parallel_unit(pstate), config=deepspeed_config(cfg, pstate.dp_size))
        self.model, self.pstate = model, pstate
        self.module = self.engine  # its forward clears ZeRO's per-backward bookkeeping
        self.zero = cfg.zero_stage > 0
        # How gradients cross DP. ZeRO-2 without pipeline stages: reduced as they come in each
        # backward (its gradient-memory saving), the step's last backward being the
        # accumulation boundary. ZeRO-1, and ZeRO-2 with stages: DeepSpeed's
        # coalesce_grad_reduction, whose backwards leave the gradients local and whose exit
        # reduces them in one pass, after the tied embedding's copies have summed theirs.
        # Stage 0: all-reduced at the step, at the boundary set there.
        self.coalesced = self.zero and not (cfg.zero_stage == 2 and pstate.pp_size == 1)
        self.coalescing = None  # the open coalesce_grad_reduction block of this step
        self.state_linked = False

    def backward(self, loss: torch.Tensor, last: bool, grad: torch.Tensor | None = None) -> None:
        """grad: the gradient of `loss` when it is a pipeline stage's output, not the loss."""
        if grad is not None:
            loss = (loss * grad).sum()  # its gradient with respect to the output is `grad`
        if self.coalesced and self.coalescing is None:
            self.engine.set_gradient_accumulation_boundary(False)
            self.coalescing = self.engine.coalesce_grad_reduction()
            self.coalescing.__enter__()
        if not self.coalesced:
            self.engine.set_gradient_accumulation_boundary(last and self.zero)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> torch.Tensor:
        sum_embedding_copies(self.model, self.master, self.pstate)
        if self.coalesced:
            self.coalescing.__exit__(None, None, None)
            self.coalescing = None
        self.engine.set_gradient_accumulation_boundary(True)
        if not self.zero:
            self.engine.allreduce_gradients()
        # Stage 0 keeps no norm to report: take it from the reduced gradients before the update.
        norm = None if self.zero else clip_grad_norm_(self.model, 0.0, self.pstate)
        self.engine.step()
        if self.zero:
            if not self.state_linked:
                # DeepSpeed 0.19 links each parameter to its slice of Adam's state right after
                # the FIRST parameter group's first update, before the other groups have any
                # state, and never again: link once more now that all have it (the state
                # tensors are updated in place from then on), or `optimizer_state` finds nothing for
                # the no-decay group.
                self._link_adam_state()
                self.state_linked = True
            norm = torch.as_tensor(self.engine.get_global_grad_norm())
        return norm

    def states(self, p: torch.nn.Parameter) -> dict[str, str]:
        return ADAMW_STATE

    def optimizer_state(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        if not self.zero:
            return state_by_name(self.optimizer, p, ADAMW_STATE)
        from deepspeed.utils import safe_get_full_optimizer_state
        # An all-reduce over DP of each rank's part of the partitioned moment: every rank calls.
        full = {m: safe_get_full_optimizer_state(p, m) for m in ADAMW_STATE}
        return {m: t for m, t in full.items() if t is not None}

    def load_optimizer_state(self, pairs, step: int) -> None:
        if not self.zero:
            # Stage 0: DeepSpeed steps torch's AdamW as it is.
            load_state(self.optimizer, {id(p): tensors for p, tensors in pairs}, step, counted=True)
            return
        from deepspeed.utils import safe_set_full_optimizer_state
        # Adam's state comes with its first step: give each flat fp32 partition (one per
        # parameter group) a zero state at `step`, link the parameters to it, then write each
        # parameter's part through DeepSpeed's public setter.
        adam = self.optimizer.optimizer
        on_device = adam.defaults.get("fused") or adam.defaults.get("capturable")  # as torch keeps it
        for flat in self.optimizer.single_partition_of_fp32_groups:
            adam.state[flat] = {"step": torch.tensor(float(step), dtype=torch.float32,
                                                     device=flat.device if on_device else "cpu"),
                                **{m: torch.zeros_like(flat) for m in ADAMW_STATE}}
        self._link_adam_state()
        for p, tensors in pairs:
            for m, full in tensors.items():
                safe_set_full_optimizer_state(p, full, m)  # this rank's part of p, if any

    def _link_adam_state(self) -> None:
        """Point each parameter's fragment at the Adam state its partition holds now. DeepSpeed
        has no public call for this (nor for making that state before a step, load_optimizer_state's
        loop): the only places that reach into its ZeRO optimizer."""
        self.optimizer._hp_optimizer_states_linked = False
        self.optimizer._lazy_init_hp_params_optimizer_state()


def _lookup(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config

