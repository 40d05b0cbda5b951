"""What a run trains: the model, and the engine `train.engine` picks (engine.py)."""
import torch

from megalite.config import ParallelConfig
from megalite.fp8.convert import convert_to_fp8, describe_fp8
from megalite.model import GPT
from megalite.parallel.random import seed_replicated_dropout
from megalite.parallel.state import ParallelState
from megalite.run_config import Config, TrainConfig, flat
from megalite.training.deepspeed_engine import DeepSpeedEngine
from megalite.training.distributed_optimizer import DistributedOptimizer
from megalite.training.engine import NativeEngine


def build_model(cfg: Config, pstate: ParallelState, init: bool = True) -> GPT:
    """The model as a training run (or a benchmark of one) uses it (init=False: weights to be
    loaded, see GPT)."""
    seed_replicated_dropout(cfg.run.seed, pstate.pp_rank * pstate.dp_size + pstate.dp_rank)
    model = GPT(cfg.model, pstate, seed=cfg.run.seed, init=init,
                activation_checkpointing=cfg.train.activation_checkpointing,
                loss_chunk_tokens=cfg.train.loss_chunk_tokens, parallel=cfg.parallel)
    chosen = convert_to_fp8(model, cfg.train.fp8, pstate)
    if cfg.train.fp8.recipe != "none" and pstate.is_main:  # 0 layers too: auto can keep them all
        print(describe_fp8(model, cfg.train.fp8, chosen, pstate), flush=True)
    if cfg.train.compile:
        # The whole forward, embedding to loss, in place (parameter names unchanged): one graph
        # at TP=1 (tests/test_compile.py); the TP collectives split it into several.
        model.compile(**compile_settings(cfg.train))
    return model


def compile_settings(t: TrainConfig) -> dict:
    """torch.compile's keyword arguments for train.compile_mode or train.compile_options
    (run_setup.check_compile has checked them)."""
    if t.compile_options:
        return {"options": inductor_options(t.compile_options)}
    return {} if t.compile_mode == "default" else {"mode": t.compile_mode}


def inductor_options(options: dict) -> dict:
    """Nested mappings as inductor's dotted names: {triton: {cudagraphs: true}} is
    {"triton.cudagraphs": true}. An empty mapping sets nothing."""
    return {name: value for name, value in flat(options).items() if value != {}}


def build_engine(model: torch.nn.Module, cfg: TrainConfig, pstate: ParallelState,
                 parallel: ParallelConfig = ParallelConfig()):
    """`parallel` sets the native engine's DP buckets (DeepSpeed has its own)."""
    if cfg.engine == "deepspeed":
        return DeepSpeedEngine(model, cfg, pstate)
    if cfg.zero_stage == 1 and pstate.grad_size > 1:
        return DistributedOptimizer(model, cfg, pstate, parallel)
    return NativeEngine(model, cfg, pstate, parallel)
