"""TP-invariant initialisation: the TP=t model holds exactly the slices of the TP=1 weights.

Each parameter is drawn IN FULL from its own generator, seeded by (seed, parameter name), so the
draw depends on neither the TP size nor module construction order; each rank keeps its slice and
frees the full tensor before drawing the next one. Bit-identical to TP=1, at the cost of drawing
the full tensor on every rank (as Megatron's CPU-init path and picotron do; Megatron's GPU path
draws only the slice and is only statistically equivalent).
"""
import hashlib
from dataclasses import dataclass

import torch

from megalite.parallel.sharding import full_shape, local_slice


@dataclass(frozen=True)
class Init:
    """normal(0, std) when std is set, else the constant `fill` (zeros for biases, ones for norms)."""

    std: float | None = None
    fill: float = 0.0


def new_param(*shape: int, std: float | None = None, fill: float = 0.0) -> torch.nn.Parameter:
    """An uninitialised parameter that init_parameters_ draws from normal(0, std), or fills with
    `fill` without a std (zeros for biases). On the default device: the model builds its parts
    under its rank's (GPT.__init__)."""
    param = torch.nn.Parameter(torch.empty(shape))
    param.megalite_init = Init(std, fill)
    return param


def draw_full(init: Init, shape: torch.Size, name: str, seed: int) -> torch.Tensor:
    """The full fp32 tensor that TP=1 would hold for parameter `name`, drawn on the CPU."""
    if init.std is None:
        return torch.full(shape, init.fill)
    # The CPU generator keeps only the low 32 bits of its seed: hash (seed, name) into them.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))
    return torch.empty(shape).normal_(0.0, init.std, generator=generator)


@torch.no_grad()
def init_parameters_(module: torch.nn.Module, seed: int) -> None:
    for name, param in module.named_parameters():
        full = draw_full(param.megalite_init, full_shape(param), name, seed)
        param.copy_(local_slice(full, param))
        del full  # before the next draw: at most one full tensor alive at a time
