"""Which layers each pipeline stage holds.

The model's layers are cut into pp x v consecutive virtual stages (v = parallel.virtual_stages,
Narayanan et al. 2021, section 2.2: "interleaved"). Pipeline rank r holds virtual stages
r, r + pp, r + 2 pp, ...: its model chunks, in the order data flows through them. Virtual stage
0 starts with the embedding; the last ends with the final norm, the LM head and the loss.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    """One virtual stage: global layers [start, end), and whether it embeds or ends the model."""

    index: int  # this rank's chunk number, 0 .. v-1
    stage: int  # the virtual stage, chunk * pp + pp_rank
    start: int
    end: int
    is_first: bool
    is_last: bool

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


def chunks_of(n_layers: int, pp: int, pp_rank: int, virtual: int = 1,
              explicit: tuple[int, ...] | None = None) -> list[Chunk]:
    """This rank's chunks. Layers per virtual stage: `explicit` (parallel.pp_layers), or an even
    split (the checks refuse layer counts it does not divide)."""
    counts = list(explicit) if explicit is not None else [n_layers // (pp * virtual)] * (pp * virtual)
    bounds = [sum(counts[:s]) for s in range(len(counts) + 1)]
    last = pp * virtual - 1
    return [Chunk(c, s, bounds[s], bounds[s + 1], s == 0, s == last)
            for c, s in enumerate(range(pp_rank, pp * virtual, pp))]
