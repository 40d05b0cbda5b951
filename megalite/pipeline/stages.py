"""Which layers each pipeline stage holds.

The model's layers are cut into pp x v consecutive virtual stages (v = parallel.virtual_stages,
Narayanan et al. 2021, section 2.2: "interleaved"). Pipeline rank r holds virtual stages
r, r + pp, r + 2 pp, ...: its model chunks, in the order data flows through them. Virtual stage
0 starts with the embedding; the last ends with the final norm, the LM head and the loss.
"""
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class Chunk:
    """One virtual stage: its global layers, and whether it embeds or ends the model."""

    layers: range
    is_first: bool
    is_last: bool


def chunks_of(n_layers: int, pp: int, pp_rank: int, virtual: int = 1,
              explicit: tuple[int, ...] | None = None) -> list[Chunk]:
    """This rank's chunks, in the order data flows through them. Layers per virtual stage:
    `explicit` (parallel.pp_layers), or an even split (the checks refuse layer counts it does
    not divide)."""
    stages = pp * virtual
    bounds = [0, *accumulate(explicit if explicit is not None else [n_layers // stages] * stages)]
    return [Chunk(range(bounds[s], bounds[s + 1]), s == 0, s == stages - 1)
            for s in range(pp_rank, stages, pp)]
