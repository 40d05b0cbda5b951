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

`message_in` and `message_out` route each action's activation or gradient: from and to which
pipeline rank, under which tag. tests/test_pipeline_schedules.py plays every rank's list
against them to show that each schedule completes (no rank waits forever), also when, as on
NCCL, each group of messages between two actions must be matched as a whole, in order.
"""
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    chunk: int  # this rank's model chunk
    micro: int  # micro-batch


def schedule(name: str, pp: int, rank: int, virtual: int, micro_batches: int) -> list[Action]:
    if name == "gpipe":
        forward = [Action("F", c, i) for c in range(virtual) for i in range(micro_batches)]
        return forward + [Action("B", c, i) for c in reversed(range(virtual)) for i in range(micro_batches)]
    if name == "1f1b" or pp == 1:
        # Rank r starts the backward of micro-batch 0 after p - r forwards: the time micro-batch 0
        # takes to reach the last stage and come back.
        return _warm_up_then_pairs(min(pp - rank - 1, micro_batches), micro_batches,
                                   lambda kind, i: Action(kind, 0, i))
    return interleaved(pp, rank, virtual, micro_batches)


def _warm_up_then_pairs(warmup: int, total: int, action) -> list[Action]:
    """`warmup` forwards, then (forward, backward) pairs, then the remaining backwards: the k-th
    forward or backward is action(kind, k)."""
    actions = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [action("F", warmup + k), action("B", k)]
    return actions + [action("B", k) for k in range(total - warmup, total)]


def interleaved(pp: int, rank: int, virtual: int, m: int) -> list[Action]:
    """Megatron's interleaved 1F1B: the k-th forward runs chunk (k // p) % v on micro-batch
    (k // (p v)) p + k % p, so groups of p micro-batches go through each chunk in turn; the k-th
    backward takes the chunks in reverse. Warm-up: 2 (p - r - 1) + (v - 1) p forwards."""
    total = m * virtual

    def action(kind: str, k: int) -> Action:
        chunk = (k // pp) % virtual
        return Action(kind, chunk if kind == "F" else virtual - 1 - chunk,
                      (k // (pp * virtual)) * pp + k % pp)

    return _warm_up_then_pairs(min(2 * (pp - rank - 1) + (virtual - 1) * pp, total), total, action)


def tag(kind: str, chunk: int, micro: int, virtual: int) -> int:
    """Unique per message of a step between two ranks: its kind, the chunk it goes to, and the
    micro-batch."""
    return (micro * virtual + chunk) * 2 + (kind == "B")


def _beside(a: Action, rank: int, pp: int, virtual: int, onward: bool) -> int | None:
    """The virtual stage next to `a`'s that its message goes to (onward) or comes from: its
    data flows up the stages forward (F) and down them backward (B); None past either end."""
    stage = a.chunk * pp + rank + (1 if (a.kind == "F") == onward else -1)
    return stage if 0 <= stage < pp * virtual else None


def message_in(a: Action, rank: int, pp: int, virtual: int) -> tuple[int, int] | None:
    """(pipeline rank, tag) of what `a` receives before it runs: the previous virtual stage's
    activation (F) or the next one's gradient (B); None at either end of the model."""
    source = producer(a, rank, pp, virtual)
    return None if source is None else (source[0], tag(a.kind, a.chunk, a.micro, virtual))


def message_out(a: Action, rank: int, pp: int, virtual: int) -> tuple[int, int] | None:
    """(pipeline rank, tag) of what `a` sends once it ran: its output to the next virtual
    stage (F) or its input's gradient to the previous one (B); None at either end."""
    target = _beside(a, rank, pp, virtual, onward=True)
    return None if target is None else (target % pp, tag(a.kind, target // pp, a.micro, virtual))


def producer(a: Action, rank: int, pp: int, virtual: int) -> tuple[int, Action] | None:
    """The (rank, action) whose message `a` receives (message_in), if any."""
    source = _beside(a, rank, pp, virtual, onward=False)
    return None if source is None else (source % pp, Action(a.kind, source // pp, a.micro))


def dependencies(a: Action, rank: int, pp: int, virtual: int) -> list[tuple[int, Action]]:
    """The (rank, action) pairs `a` on `rank` waits for: its message's producer, and for a
    backward this rank's forward of the same chunk and micro-batch."""
    source = producer(a, rank, pp, virtual)
    own = [(rank, Action("F", a.chunk, a.micro))] if a.kind == "B" else []
    return own + ([source] if source else [])


@dataclass(frozen=True)
class Exchange:
    """Messages a rank posts at once: the outputs of `sends` and the inputs of `recvs`."""

    sends: tuple[Action, ...]
    recvs: tuple[Action, ...]


@functools.cache
def plan(name: str, pp: int, rank: int, virtual: int, m: int,
         forward_only: bool = False) -> tuple[Action | Exchange, ...]:
    """This rank's actions in the schedule's order, with the exchanges that move their messages.

    All ranks are played in lock-step ticks: in each tick a rank runs its next action if what it
    waits for ran in an earlier tick. A message made in tick t is sent and received in the
    exchange right after tick t, on both ranks. So every rank posts its exchanges in tick order
    and both ends of every message are in the same tick's exchange: NCCL, which runs a rank's
    groups one after the other and completes a send only with its receive, can always finish
    them (tests/test_pipeline_schedules.py); gloo matches them by tag anyway.
    """
    lists = [[a for a in schedule(name, pp, r, virtual, m) if a.kind == "F" or not forward_only]
             for r in range(pp)]
    tick_of: dict[tuple[int, Action], int] = {}
    position, tick = [0] * pp, 0
    while any(position[r] < len(lists[r]) for r in range(pp)):
        ready = [r for r in range(pp) if position[r] < len(lists[r]) and
                 all(d in tick_of for d in dependencies(lists[r][position[r]], r, pp, virtual))]
        if not ready:
            raise RuntimeError(f"pipeline schedule {name} (pp={pp}, v={virtual}, m={m}) "
                               f"deadlocks at {position}")
        for r in ready:
            tick_of[r, lists[r][position[r]]] = tick
            position[r] += 1
        tick += 1
    mine = {tick_of[rank, a]: a for a in lists[rank]}
    arriving: dict[int, list[Action]] = {}
    for a in lists[rank]:
        if source := producer(a, rank, pp, virtual):
            arriving.setdefault(tick_of[source], []).append(a)
    steps: list[Action | Exchange] = []
    for t in range(-1, tick):
        if t in mine:
            steps.append(mine[t])
        sends = (mine[t],) if t in mine and message_out(mine[t], rank, pp, virtual) else ()
        recvs = tuple(arriving.get(t, ()))
        if sends or recvs:
            steps.append(Exchange(sends, recvs))
    return tuple(steps)
