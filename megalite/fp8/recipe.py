"""FP8 matmuls with torchao's float8 training: its recipes (Float8LinearConfig), casts
(Float8TrainingTensor) and scaled matmuls, in the order of torchao's own Float8Linear, so that one
process computes what Float8Linear computes, bit for bit (tests/test_fp8.py).

What megalite adds is where each scale's amax is reduced. A scale covers dims of a tensor (all of
them tensorwise; rowwise, the contracted one); where a parallel layer holds a slice of such a dim,
the amax is reduced (MAX) over exactly the group that splits it (parallel/matmul.Splits), so that
the scale is one process's. torchao's own reduction covers the whole world or a DTensor mesh:
megalite's layers are neither.

    output      = X [M, K]  . W^T [K, N]   X scaled over K (rowwise) or M, K; W over K or K, N
    grad_input  = dY [M, N] . W   [N, K]   dY over N or M, N; W over N or K, N
    grad_weight = dY^T      . X            both over M (rowwise) or as above
"""
import dataclasses
import logging

import torch
import torch.distributed as dist

from megalite.parallel.layers import GatheredLinear
from megalite.parallel.mappings import all_reduce_over
from megalite.parallel.matmul import Splits


# Importing torchao warns once per CUDA extension it cannot load (on a CPU, each of them: FP8
# here runs torch._scaled_mm, not those kernels) and of an Enum torch.compile handles: quieted.
_LOGGERS = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
_LEVELS = [logger.level for logger in _LOGGERS]
for _logger in _LOGGERS:
    _logger.setLevel(logging.ERROR)
try:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import CastConfig, ScalingType
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_training_tensor import (GemmInputRole, LinearMMConfig,
                                                       ScaledMMConfig, hp_tensor_and_scale_to_float8)
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
finally:
    for _logger, _level in zip(_LOGGERS, _LEVELS):
        _logger.setLevel(_level)

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def float8_config(recipe: str, emulate: bool, pad_inner_dim: bool = False) -> Float8LinearConfig:
    """torchao's recipe; pad_inner_dim: zeros pad each matmul's summed dim to a multiple of 16,
    which torch._scaled_mm needs on a GPU (the experts' weight gradients sum over their rows,
    as many as the router sent)."""
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                               pad_inner_dim=pad_inner_dim)


def amax(t: torch.Tensor, cast: CastConfig, dim: int | None) -> torch.Tensor:
    """torchao's amax of t (per slice along dim, or whole); zeros for an empty t (an expert
    with no rows here still joins the reduction)."""
    if t.numel():
        return tensor_to_amax(t, False, None, cast.scaling_granularity, dim)
    shape = () if dim is None else tuple(1 if i == dim % t.dim() else n for i, n in enumerate(t.shape))
    return t.new_zeros(shape)


class Float8Matmul:
    """A precision recipe (parallel/matmul.py) casting to FP8 as torchao's `config` says."""

    def __init__(self, config: Float8LinearConfig):
        self.config = config
        # As Float8Linear builds it: output, grad_input, grad_weight.
        self.mm_config = LinearMMConfig(*(
            ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
            for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                         config.gemm_config_grad_weight)))

    def cast(self, t: torch.Tensor, cast: CastConfig, role: GemmInputRole, axis: int,
             dims: str, splits: Splits):
        """t (2-D, its dims named by `dims`, e.g. 'mk') in FP8, scaled along `axis` if the cast
        is rowwise, the amax reduced over the groups splitting the dims the scale covers."""
        if cast.scaling_type is ScalingType.DISABLED:
            return t
        dim = get_maybe_axiswise_dim(axis, cast.scaling_granularity)
        a = amax(t, cast, dim)
        all_reduce_over(a, *splits.of(dims if dim is None else dims[dim]), op=dist.ReduceOp.MAX)
        scale = amax_to_scale(a, cast.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, self.mm_config, role, dim)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               splits: Splits) -> torch.Tensor:
        # X W^T in FP8 forward and backward (torchao's matmul_with_hp_or_float8_args, with the
        # amax reductions of `cast`); X read in autocast's dtype, as Float8Linear reads it, so
        # that the output is in that dtype.
        y = GatheredLinear.apply(x, None, weight, None, self, splits)
        return y if bias is None else y + bias.to(y.dtype)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                splits: Splits) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        a = self.cast(rows, self.config.cast_config_input, GemmInputRole.INPUT, -1, "mk", splits)
        b = self.cast(weight.t(), self.config.cast_config_weight, GemmInputRole.WEIGHT, 0, "kn", splits)
        y = torch.mm(a, b) if rows.shape[0] else rows.new_zeros(0, weight.shape[0])
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias.to(y.dtype)

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor, splits: Splits) -> torch.Tensor:
        c = self.config
        rows = grad.reshape(-1, grad.shape[-1])
        g = self.cast(rows, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, "mn", splits)
        w = self.cast(weight.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1,
                      "kn", splits)
        out = torch.mm(g, w.t()) if rows.shape[0] else rows.new_zeros(0, weight.shape[1])
        return out.reshape(*grad.shape[:-1], out.shape[-1])

    def grad_weight(self, grad: torch.Tensor, x: torch.Tensor, splits: Splits) -> torch.Tensor:
        """grad [M, N], x [M, K] -> [N, K]."""
        c = self.config
        g = self.cast(grad, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT,
                      0, "mn", splits)
        a = self.cast(x, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, "mk", splits)
        return torch.mm(g.t(), a) if grad.shape[0] else grad.new_zeros(grad.shape[1], x.shape[1])

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, per_expert: list[int],
                splits: Splits) -> torch.Tensor:
        """The experts (parallel/matmul.HighPrecision.grouped) one by one, each scaled alone;
        an expert with no rows here still joins the reductions."""
        return torch.cat([self.linear(part, weight[e], None, splits)
                          for e, part in enumerate(x.split(per_expert))])
