"""The parameter groups: which optimizer steps which tensor, with which settings.

adamw: every parameter, matrices (linear weights, embeddings) decayed, vectors (biases, norm
weights) not. muon: the blocks' matrices (attention, MLP, router and expert weights) to Muon,
the rest (embeddings, positions, LM head, norms, biases) to AdamW as above, the choice of every
reference setup (torch.optim.Muon's docs, Moonlight, Megatron's muon).
"""
from typing import Callable

import torch

from megalite.run_config import TrainConfig
from megalite.training.optimizers.chained import ChainedOptimizer
from megalite.training.optimizers.matrices import MatrixLayout, layout_of
from megalite.training.optimizers.muon import Muon


def takes_muon(name: str, p: torch.Tensor) -> bool:
    return name.startswith("blocks.") and p.dim() >= 2 and p.requires_grad


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
    to_muon = [p for n, p in named if cfg.optimizer == "muon" and takes_muon(n, p)]
    chosen = {id(p) for p in to_muon}
    rest = [master(p) for _, p in named if id(p) not in chosen]
    optimizers = [adamw(rest, cfg, pstate.device)] if rest else []
    if to_muon:
        m = cfg.muon
        optimizers.append(Muon([master(p) for p in to_muon], {id(master(p)): layout(p) for p in to_muon}, m))
        # The schedule scales Muon's rate as it scales train.lr (engine.set_lr).
        for group in optimizers[-1].param_groups:
            group["lr_ratio"] = m.lr / cfg.lr
    return ChainedOptimizer(optimizers)


def describe_optimizers(model: torch.nn.Module, cfg: TrainConfig, pstate) -> str | None:
    """The start's line for train.optimizer=muon (None for adamw, which the lr line says):
    what Muon steps and its rate beside AdamW's, since the schedule line and the progress bar
    show train.lr only."""
    if cfg.optimizer != "muon":
        return None
    named = list(model.named_parameters())
    muon = sum(takes_muon(n, p) for n, p in named)
    stage = " of rank 0's pipeline stage" if pstate.pp_size > 1 else ""
    return (f"optimizer: muon for the blocks' {muon} weight matrices{stage} at lr {cfg.muon.lr:.3g} "
            f"(train.muon.lr), adamw for the other {len(named) - muon} parameters at lr "
            f"{cfg.lr:.3g} (train.lr); the schedule scales both, the progress bar shows adamw's")
