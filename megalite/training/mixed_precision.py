"""train.precision=pure_bf16, Megatron's mixed precision: bf16 weights and activations, fp32
wherever numbers accumulate.

The model's parameters are bf16, so forward and backward run in bf16 without autocast. Each
parameter has an fp32 master copy: the optimizer steps the masters (its Adam moments are fp32
too) and checkpoints save them. Each bf16 gradient is added into its master's fp32 gradient as
soon as backward has accumulated it, then freed, so micro-batches accumulate in fp32 and the DP
all-reduce and the clipping norm see fp32 sums. After each step the model takes the masters
rounded to bf16.
"""
from functools import partial
from typing import Callable

import torch
from torch import nn



class MasterWeights(nn.Module):
    """fp32 masters of a model's parameters, copied from its weights as they are now (fp32),
    after which the model's parameters are cast to bf16 in place.

    A module whose parameters carry the model's TP shards, so the optimizer, the DP sync and the
    clipping take it as they take the model. Each master's gradient is a kept fp32 buffer (zero
    it in place, never set it to None): backward's hooks add into it.

    rows(p) -> (start, stop): the rows of each parameter the masters hold (the distributed
    optimizer's share). Such masters get no gradient buffer here: the distributed optimizer
    accumulates the full gradients, and sets their rows' sums as the masters' gradients.
    """

    def __init__(self, model: nn.Module,
                 rows: Callable[[torch.Tensor], tuple[int, int]] | None = None):
        super().__init__()
        # Frozen parameters (MoE's expert bias, moved by the trainer) stay fp32, their own master.
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.params = nn.ParameterList()
        for p in self.model_params:
            start, stop = (0, p.shape[0]) if rows is None else rows(p)
            master = copy_marks(nn.Parameter(p.detach()[start:stop].float().clone()), p)
            if rows is None:
                master.grad = torch.zeros_like(master)
            self.params.append(master)
            # Parameters only: buffers such as the rotary frequencies stay fp32.
            p.data = p.data.to(torch.bfloat16)
        self.by_model_param = {id(p): m for p, m in zip(self.model_params, self.params)}

    def master(self, p: torch.Tensor) -> nn.Parameter:
        """The fp32 master of model parameter p."""
        return self.by_model_param.get(id(p), p)

    def accumulate_grads(self, then: Callable[[nn.Parameter], None]) -> None:
        """From now on, as soon as backward has accumulated a model parameter's gradient, add it
        into its master's gradient, free it, and call then(master)."""
        for p, master in zip(self.model_params, self.params):
            p.register_post_accumulate_grad_hook(partial(_accumulate, master, then))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Set the model's parameters to the masters rounded to bf16 (to nearest even)."""
        for p, master in zip(self.model_params, self.params):
            p.copy_(master)


def copy_marks(tensor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Give `tensor` (p's master, or a block of p's rows) p's TP or EP shard and tied-copy marks,
    which the clipping norm reads; return it."""
    for mark in ("tp_shard", "ep_shard"):
        if hasattr(p, mark):
            setattr(tensor, mark, getattr(p, mark))
    tensor.pipeline_copy = getattr(p, "pipeline_copy", False)
    return tensor


def _accumulate(master: nn.Parameter, then: Callable[[nn.Parameter], None],
                p: torch.Tensor) -> None:
    master.grad.add_(p.grad)
    p.grad = None
    then(master)
