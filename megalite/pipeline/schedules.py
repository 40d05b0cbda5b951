"""The order in which one pipeline rank runs its forwards (F) and backwards (B) in a step.

Each schedule is a list of Actions per rank; the runner (runner.py) carries them out and moves
activations and gradients between neighbours. With m micro-batches, p stages and v model
chunks per rank (Narayanan et al. 2021):

| schedule    | order on rank r                                    | bubble        | in flight |
|-------------|----------------------------------------------------|---------------|-----------|
| gpipe       | every F, then every B (Huang et al. 2019)          | (p-1)/m       | m         |
| 1f1b        | p-r-1 warm-up Fs, then F,B pairs, then the last Bs | (p-1)/m       | <= p      |
| interleaved | 1f1b over v chunks, chunk order changing every p   | (p-1)/(v m)   | <= ~2p+vp |
|             | micro-batches (m a multiple of p)                  |               |           |

`dependencies` states what each action waits for, and tests/test_pipeline_schedules.py plays
every rank's list against them to show that each schedule completes (no rank waits forever).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    chunk: int  # this rank's model chunk
    micro: int  # micro-batch


def schedule(name: str, pp: int, rank: int, virtual: int, micro_batches: int) -> list[Action]:
    if name == "gpipe":
        return gpipe(virtual, micro_batches)
    if name == "1f1b" or pp == 1:
        return one_f_one_b(pp, rank, micro_batches)
    return interleaved(pp, rank, virtual, micro_batches)


def gpipe(virtual: int, m: int) -> list[Action]:
    forward = [Action("F", c, i) for c in range(virtual) for i in range(m)]
    backward = [Action("B", c, i) for c in reversed(range(virtual)) for i in range(m)]
    return forward + backward


def one_f_one_b(pp: int, rank: int, m: int) -> list[Action]:
    # Rank r starts the backward of micro-batch 0 after p - r forwards: the time micro-batch 0
    # takes to reach the last stage and come back.
    warmup = min(pp - rank - 1, m)
    actions = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return actions + [Action("B", 0, i) for i in range(m - warmup, m)]


def interleaved(pp: int, rank: int, virtual: int, m: int) -> list[Action]:
    """Megatron's interleaved 1F1B: the k-th forward runs chunk (k // p) % v on micro-batch
    (k // (p v)) p + k % p, so groups of p micro-batches go through each chunk in turn; the k-th
    backward takes the chunks in reverse. Warm-up: 2 (p - r - 1) + (v - 1) p forwards."""
    total = m * virtual

    def action(kind: str, k: int) -> Action:
        chunk = (k // pp) % virtual
        return Action(kind, chunk if kind == "F" else virtual - 1 - chunk,
                      (k // (pp * virtual)) * pp + k % pp)

    warmup = min(2 * (pp - rank - 1) + (virtual - 1) * pp, total)
    actions = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [action("F", warmup + k), action("B", k)]
    return actions + [action("B", k) for k in range(total - warmup, total)]


def dependencies(a: Action, rank: int, pp: int, virtual: int) -> list[tuple[int, Action]]:
    """The (rank, action) pairs whose messages `a` on `rank` needs: the previous virtual
    stage's forward (for F), the next one's backward (for B); the loss needs this stage's F."""
    stage = a.chunk * pp + rank
    if a.kind == "F":
        if stage == 0:
            return []
        return [((rank - 1) % pp, Action("F", (stage - 1) // pp, a.micro))]
    here = [(rank, Action("F", a.chunk, a.micro))]
    if stage == pp * virtual - 1:
        return here
    return here + [((rank + 1) % pp, Action("B", (stage + 1) // pp, a.micro))]
