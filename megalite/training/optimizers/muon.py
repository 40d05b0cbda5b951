"""Muon (Keller Jordan's; torch.optim.Muon's arithmetic and settings): momentum, then each
logical matrix of the update orthogonalised by Newton-Schulz iterations, scaled per its shape.

The momentum and the weight update are element-wise, so they run on whatever rows a rank holds;
the iterations need the whole logical matrix, which `MatrixLayout.whole` gathers (TP slices,
ZeRO-1 rows) and splits (fused K/V, stacked experts) and `MatrixLayout.mine` cuts back.
Given the same gradients, a rank's rows of the update are those of one process's.
"""
import dataclasses
import math

import torch

from megalite.training.optimizers.chained import ROWS
from megalite.training.optimizers.matrices import MatrixLayout

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The quintic iteration towards U V^T of g = U S V^T, on the wide orientation (the
    smaller Gram matrix), in `dtype`; torch.optim.Muon's order of operations."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(rule: str, shape: torch.Size) -> float:
    """The update's scale for an A x B matrix (torch.optim.Muon's adjust_lr_fn)."""
    rows, cols = shape[:2]
    if rule == "original":
        return math.sqrt(max(1, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


class Muon(torch.optim.Optimizer):
    """Muon over tensors each described by a MatrixLayout (`layouts`, by the tensor's id): its
    logical matrices are orthogonalised whole, whichever part of them the tensor is."""

    states = {"momentum_buffer": ROWS}
    steps_counted = False  # no step count in its state

    def __init__(self, params, layouts: dict[int, MatrixLayout], settings):
        """settings: train.muon (run_config.MuonConfig), every field a parameter group's default."""
        super().__init__(params, {**dataclasses.asdict(settings),
                                  "ns_coefficients": tuple(settings.ns_coefficients)})
        self.layouts = layouts

    @torch.no_grad()
    def step(self, closure=None):
        # Every rank of a tensor's TP and replica groups steps the same tensors in the same
        # order (a missing gradient is missing on all of them): the gathers line up.
        for group in self.param_groups:
            mu, lr = group["momentum"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                layout = self.layouts[id(p)]
                matrices = layout.matrices(layout.whole(update))
                shapes = {m.shape for m in matrices}
                assert len(shapes) == 1, f"one scale per tensor: {shapes}"  # fused parts match
                ortho = [newton_schulz(m, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                       DTYPES[group["ns_dtype"]]) for m in matrices]
                update = layout.mine(layout.join(ortho))
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * lr_ratio(group["adjust_lr"], shapes.pop()))
