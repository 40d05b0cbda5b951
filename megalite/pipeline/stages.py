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


def layer_counts(n_layers: int, stages: int, explicit: tuple[int, ...] | None) -> list[int]:
    """Layers per virtual stage: `explicit` (parallel.pp_layers), or an even split (the checks
    refuse layer counts it does not divide)."""
    if explicit is not None:
        return list(explicit)
    return [n_layers // stages] * stages


def chunks_of(n_layers: int, pp: int, pp_rank: int, virtual: int = 1,
              explicit: tuple[int, ...] | None = None) -> list[Chunk]:
    counts = layer_counts(n_layers, pp * virtual, explicit)
    bounds = [sum(counts[:s]) for s in range(len(counts) + 1)]
    last = pp * virtual - 1
    return [Chunk(c, s, bounds[s], bounds[s + 1], s == 0, s == last)
            for c, s in enumerate(range(pp_rank, pp * virtual, pp))]


def pipeline_problems(n_layers: int | None, pp: int, virtual: int, explicit: tuple[int, ...] | None,
                      schedule: str, micro_batches: int | None) -> list[str]:
    """Every way this pipeline layout cannot run, one line each (empty: it can); n_layers None:
    the model is not known yet."""
    if pp < 1 or virtual < 1:
        return [f"parallel.pp={pp} and parallel.virtual_stages={virtual} must be >= 1"]
    stages = pp * virtual
    problems = []
    if virtual > 1 and schedule != "interleaved":
        problems.append(f"parallel.virtual_stages={virtual} needs parallel.pp_schedule=interleaved "
                        f"(got {schedule}): set it, or virtual_stages=1")
    if schedule == "interleaved" and pp > 1 and virtual < 2:
        problems.append("parallel.pp_schedule=interleaved needs parallel.virtual_stages >= 2 "
                        "model chunks per rank: set it, or use pp_schedule=1f1b")
    if n_layers is None:
        pass
    elif explicit is not None:
        if len(explicit) != stages or any(n < 1 for n in explicit) or sum(explicit) != n_layers:
            problems.append(f"parallel.pp_layers={list(explicit)} must give each of the "
                            f"pp x virtual_stages = {stages} stages >= 1 layer, "
                            f"{n_layers} (model.n_layers) in all")
    elif n_layers % stages:
        problems.append(f"model.n_layers={n_layers} does not split evenly into pp x "
                        f"virtual_stages = {stages} stages: give parallel.pp_layers (layers per "
                        f"stage, e.g. {_uneven_example(n_layers, stages)}; megalite generate: "
                        f"--pp-layers) or change pp")
    if micro_batches is not None and pp > 1 and schedule != "gpipe" and micro_batches % pp:
        # Megatron's rule for the interleaved schedule; for 1F1B, fewer micro-batches than
        # stages would leave the steady phase empty and the bubble over half the step.
        problems.append(f"pp_schedule={schedule} needs the micro-batches per step "
                        f"({micro_batches} = global batch / (micro batch x DP)) to be a multiple "
                        f"of parallel.pp={pp}: change train.global_batch_size or "
                        f"train.micro_batch_size")
    return problems


def _uneven_example(n_layers: int, stages: int) -> list[int] | str:
    if n_layers < stages:
        return f"impossible with {n_layers} layers; lower pp or virtual_stages"
    base, extra = divmod(n_layers, stages)
    return [base + (s < extra) for s in range(stages)]
