"""The parameter groups: which optimizer steps which tensor, with which settings.

adamw: every parameter, matrices (linear weights, embeddings) decayed, vectors (biases, norm
weights) not. muon: the blocks' matrices (attention, MLP, router and expert weights) to Muon,
the rest (embeddings, positions, LM head, norms, biases) to AdamW as above, the choice of every
reference setup (torch.optim.Muon's docs, Moonlight, Megatron's muon). adafactor: every matrix
to Adafactor (torch.optim.Adafactor, each logical matrix whole), the vectors to AdamW.
"""
from typing import Callable

import torch

from megalite.run_config import TrainConfig
from megalite.training.optimizers.adafactor import Adafactor
from megalite.training.optimizers.chained import ChainedOptimizer
from megalite.training.optimizers.matrices import MatrixLayout, layout_of
from megalite.training.optimizers.muon import Muon


def takes_muon(name: str, p: torch.Tensor) -> bool:
    return name.startswith("blocks.") and p.dim() >= 2 and p.requires_grad


def a_matrix(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 2 and p.requires_grad


# train.optimizer -> (the optimizer of whole matrices, which parameters it takes, the start's words for them)
MATRIX_OPTIMIZERS = {"muon": (Muon, takes_muon, "the blocks'"), "adafactor": (Adafactor, a_matrix, "all")}


def adamw(params: list[torch.Tensor], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, pstate,
                    master: Callable = lambda p: p,
                    layout: Callable[[torch.nn.Parameter], MatrixLayout] | None = None
                    ) -> ChainedOptimizer:
    """The optimizers of `model`'s parameters, each stepping master(p) (the tensor an engine
    hands over: p, its fp32 master, or rows of either); layout(p): where master(p) sits in
    p's whole matrix (default: p's local tensor, whole)."""
    layout = layout or (lambda p: layout_of(p, pstate))
    named = list(model.named_parameters())
    make, takes, _ = MATRIX_OPTIMIZERS.get(cfg.optimizer, (None, lambda n, p: False, ""))
    matrices = [p for n, p in named if takes(n, p)]
    chosen = {id(p) for p in matrices}
    rest = [master(p) for _, p in named if id(p) not in chosen]
    optimizers = [adamw(rest, cfg, pstate.device)] if rest else []
    if matrices:
        settings = getattr(cfg, cfg.optimizer)
        optimizers.append(make([master(p) for p in matrices], {id(master(p)): layout(p) for p in matrices},
                               settings))
        # The schedule scales its rate as it scales train.lr (engine.set_lr).
        for group in optimizers[-1].param_groups:
            group["lr_ratio"] = settings.lr / cfg.lr
    return ChainedOptimizer(optimizers)


def describe_optimizers(model: torch.nn.Module, cfg: TrainConfig, pstate) -> str | None:
    """The start's line for train.optimizer=muon or adafactor (None for adamw, which the lr line
    says): what each steps and at which rate, since the schedule line and the progress bar show
    train.lr only."""
    if cfg.optimizer not in MATRIX_OPTIMIZERS:
        return None
    _, takes, which = MATRIX_OPTIMIZERS[cfg.optimizer]
    named = list(model.named_parameters())
    n = sum(takes(name, p) for name, p in named)
    stage = " of rank 0's pipeline stage" if pstate.pp_size > 1 else ""
    key = f"train.{cfg.optimizer}.lr"
    return (f"optimizer: {cfg.optimizer} for {which} {n} weight matrices{stage} at lr "
            f"{getattr(cfg, cfg.optimizer).lr:.3g} ({key}), adamw for the other {len(named) - n} "
            f"parameters at lr {cfg.lr:.3g} (train.lr); the schedule scales both, the progress bar "
            f"shows adamw's")
