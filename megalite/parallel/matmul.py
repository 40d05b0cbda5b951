"""The one seam every weight matmul of the model goes through: Y = X W^T (+ b), W [out, in] as
nn.Linear holds it, X [..., in].

The parallel layers decide what is communicated; a precision recipe (`Matmul`) decides only how
the product is computed: HIGH, the matmul in the tensors' own dtype (autocast's under autocast),
or megalite/fp8's casts to float8 (torchao). A recipe sees `Splits`: which process groups cut
this rank's operands out of the logical ones, so that whatever it derives from a whole tensor
(FP8's amax) it can reduce over exactly those groups and equal one process.

    X [M, K]   M (tokens) split over Splits.tokens, K over Splits.inner (row-parallel)
    W [N, K]   N split over Splits.outer (column-parallel), K over Splits.inner
    dY [M, N]  M over Splits.tokens, N over Splits.outer
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megalite.parallel.mappings import group_size


@dataclass(frozen=True)
class Splits:
    tokens: tuple = ()  # groups whose ranks' rows together are the rows one process multiplies
    inner: object = None  # the group splitting K (row-parallel's input and weight)
    outer: object = None  # the group splitting N (column-parallel's weight and output)

    def of(self, dims: str) -> tuple:
        """The distinct groups of more than one rank that split any of `dims` ('m', 'k', 'n')."""
        named = {"m": self.tokens, "k": (self.inner,), "n": (self.outer,)}
        found = [g for dim in "mkn" if dim in dims for g in named[dim]]
        # dict.fromkeys: the first of each group, by identity (process groups have no __eq__).
        return tuple(g for g in dict.fromkeys(found) if group_size(g) > 1)


NO_SPLITS = Splits()


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul reads x in: autocast's when it is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class HighPrecision:
    """The matmul in the operands' dtype: F.linear, and the two backward products of a layer
    that writes its own backward (layers.GatheredLinear)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               splits: Splits) -> torch.Tensor:
        return F.linear(x, weight, bias)

    # Inside an autograd function that writes its own backward (layers.GatheredLinear).
    forward = linear

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor, splits: Splits) -> torch.Tensor:
        return grad.matmul(weight.to(grad.dtype))

    def grad_weight(self, grad: torch.Tensor, x: torch.Tensor, splits: Splits) -> torch.Tensor:
        """grad [M, N], x [M, K] (2-D) -> [N, K]."""
        return grad.t().matmul(x.to(grad.dtype))

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, per_expert: list[int],
                splits: Splits) -> torch.Tensor:
        """Each expert's rows of x (expert-major) times its weight [experts, out, in]: on a GPU
        in bf16 (autocast, or bf16 weights) one grouped matmul (the fast kernel takes bf16 only),
        else a loop over the experts."""
        if x.is_cuda and (torch.is_autocast_enabled("cuda") or weight.dtype == torch.bfloat16):
            ends = torch.tensor(per_expert, device=x.device).cumsum(0).to(torch.int32)
            return F.grouped_mm(x.to(torch.bfloat16), weight.to(torch.bfloat16).transpose(1, 2),
                                offs=ends)
        return torch.cat([F.linear(part, weight[e]) for e, part in enumerate(x.split(per_expert))])


HIGH = HighPrecision()


def shared_matmul(recipes):
    """The recipe of a fused matmul (Q and KV, gate and up): its layers' common one, or HIGH
    when they differ (a fused matmul runs in FP8 only when each of its layers was chosen)."""
    first, *rest = recipes
    return first if all(r is first for r in rest) else HIGH
