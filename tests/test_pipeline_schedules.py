"""Pipeline schedules complete, hold what they promise, and bad pipeline configs are refused
before any process group exists."""
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.parallel.state import ParallelState
from megalite.parallel.p2p import Message, PipeComm
from megalite.pipeline.schedules import (Action, Exchange, dependencies, message_in, message_out,
                                         plan, schedule)
from megalite.pipeline.stages import chunks_of
from megalite.run_config import load_config
from megalite.plan import validate
from megalite.typed_config import ConfigError
from tests.support.harness import run_distributed


def play(name: str, pp: int, virtual: int, m: int) -> int:
    """Run every rank's action list, one action per rank per tick when its messages are there;
    return the ticks taken. Fails if no rank can move (a deadlock)."""
    lists = [schedule(name, pp, r, virtual, m) for r in range(pp)]
    done: set[tuple[int, Action]] = set()
    position, ticks = [0] * pp, 0
    while any(position[r] < len(lists[r]) for r in range(pp)):
        ready = [r for r in range(pp) if position[r] < len(lists[r]) and
                 all(d in done for d in dependencies(lists[r][position[r]], r, pp, virtual))]
        assert ready, f"{name} p={pp} v={virtual} m={m}: deadlock at {position}"
        for r in ready:
            done.add((r, lists[r][position[r]]))
            position[r] += 1
        ticks += 1
    return ticks


@pytest.mark.unit
@pytest.mark.parametrize("name,virtual", [("gpipe", 1), ("gpipe", 2), ("1f1b", 1),
                                          ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 6), (4, 4), (4, 8)])
def test_every_schedule_completes_each_action_once(name, virtual, pp, m):
    play(name, pp, virtual, m)
    for r in range(pp):
        actions = schedule(name, pp, r, virtual, m)
        want = {(k, c, i) for k in "FB" for c in range(virtual) for i in range(m)}
        assert sorted((a.kind, a.chunk, a.micro) for a in actions) == sorted(want)
        for a in actions:
            if a.kind == "B":
                assert actions.index(Action("F", a.chunk, a.micro)) < actions.index(a)


def groups(name: str, pp: int, rank: int, virtual: int, m: int) -> list[list[tuple]]:
    """The runner's message groups on one rank, (op, peer, tag) each: its plan's exchanges."""
    result = []
    for item in plan(name, pp, rank, virtual, m):
        if isinstance(item, Exchange):
            result.append([("send", *message_out(a, rank, pp, virtual)) for a in item.sends] +
                          [("recv", *message_in(a, rank, pp, virtual)) for a in item.recvs])
    return result


def numbered(rank_groups: list[list[tuple]]) -> list[list[tuple]]:
    """Each (op, peer, tag) as (op, peer, n): the n-th op of its kind with that peer."""
    seen: Counter = Counter()
    result = []
    for group in rank_groups:
        ops = []
        for op, peer, _ in group:
            seen[op, peer] += 1
            ops.append((op, peer, seen[op, peer]))
        result.append(ops)
    return result


def completes_as_nccl_runs_groups(name: str, pp: int, virtual: int, m: int) -> bool:
    """NCCL's rule, strictly: each rank runs its groups one after the other; a send and its
    receive (the n-th between two ranks in that direction; NCCL ignores tags) complete only
    while both ranks run the groups holding them. True if every group completes."""
    ops = [numbered(groups(name, pp, r, virtual, m)) for r in range(pp)]
    current, done = [0] * pp, set()  # done: (rank, op, peer, n)
    while any(current[r] < len(ops[r]) for r in range(pp)):
        running = {r: ops[r][current[r]] for r in range(pp) if current[r] < len(ops[r])}
        for r, group in running.items():
            for op, peer, n in group:
                other = ("recv" if op == "send" else "send", r, n)
                if other in running.get(peer, []):
                    done |= {(r, op, peer, n), (peer, *other)}
        finished = [r for r, group in running.items() if all((r, *o) in done for o in group)]
        if not finished:
            return False
        for r in finished:
            current[r] += 1
    return True


@pytest.mark.unit
@pytest.mark.parametrize("name,virtual", [("gpipe", 1), ("gpipe", 2), ("1f1b", 1),
                                          ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("pp,m", [(2, 2), (2, 6), (4, 4), (4, 8)])
def test_message_groups_match_in_order_and_complete_as_nccl_runs_them(name, virtual, pp, m):
    """The n-th message each way between two ranks is the same one (the same tag) at both
    ends, so NCCL, which ignores tags, pairs them right; and the groups complete under NCCL's
    rule. (Posting, instead, what one action sends with what the next one receives completes
    for GPipe and 1F1B but deadlocks for interleaved 1F1B at p=4, v=2, m=8.)"""
    lists = [groups(name, pp, r, virtual, m) for r in range(pp)]
    for r in range(pp):
        for q in range(pp):
            sent = [t for g in lists[r] for op, peer, t in g if op == "send" and peer == q]
            received = [t for g in lists[q] for op, peer, t in g if op == "recv" and peer == r]
            assert sent == received, f"{r}->{q}: sent {sent}, received {received}"
    assert completes_as_nccl_runs_groups(name, pp, virtual, m)


@pytest.mark.unit
def test_a_plan_runs_every_action_once_with_its_message_exchanged_before():
    for rank in range(4):
        steps = plan("interleaved", 4, rank, 2, 8)
        actions = [s for s in steps if isinstance(s, Action)]
        assert actions == schedule("interleaved", 4, rank, 2, 8)
        for k, a in enumerate(steps):
            if isinstance(a, Exchange):
                assert all(steps.index(r) > k for r in a.recvs)
                assert all(steps.index(s) < k for s in a.sends)


def in_flight(actions: list[Action]) -> int:
    """The most forwards whose backward has not run yet: the activations a rank holds."""
    held = most = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1
        most = max(most, held)
    return most


@pytest.mark.unit
@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8)])
def test_1f1b_holds_at_most_pp_micro_batches_where_gpipe_holds_all(pp, m):
    for r in range(pp):
        assert in_flight(schedule("1f1b", pp, r, 1, m)) == pp - r
        assert in_flight(schedule("gpipe", pp, r, 1, m)) == m


@pytest.mark.unit
def test_interleaving_shrinks_the_bubble():
    """In ticks of one chunk's forward or backward, the ideal step is 2 v m; the bubble adds
    about 2 (p - 1) ticks with v chunks of 1/v the work, i.e. (p - 1) / (v m) of the step."""
    pp, m = 4, 8
    plain = play("1f1b", pp, 1, m) - 2 * m
    interleaved = play("interleaved", pp, 2, m) - 2 * 2 * m
    assert plain == 2 * (pp - 1)
    # Twice the ticks of half the size: the same count of idle ticks is half the time.
    assert interleaved <= 2 * plain


@pytest.mark.unit
def test_stages_split_layers_and_ends():
    chunks = [chunks_of(8, 4, r, 2) for r in range(4)]
    assert [c.layers for c in chunks[0]] == [range(0, 1), range(4, 5)]
    assert chunks[0][0].is_first and chunks[3][1].is_last
    assert not any(c.is_last for c in chunks[0]) and not any(c.is_first for c in chunks[3])
    assert [c.layers for c in chunks_of(5, 2, 1, 1, (2, 3))] == [range(2, 5)]


BAD = {
    "parallel.pp=3": "is not divisible by parallel.tp x parallel.pp",
    "parallel.pp=2 model.n_layers=3": "does not split evenly",
    "parallel.pp=2 parallel.virtual_stages=2": "needs parallel.pp_schedule=interleaved",
    "parallel.pp=2 parallel.pp_schedule=interleaved": "needs parallel.virtual_stages >= 2",
    "parallel.pp=2 train.micro_batch_size=3 train.global_batch_size=6": "multiple of parallel.pp=2",
    "parallel.pp=2 parallel.pp_layers=[1,2]": "parallel.pp_layers=[1, 2]",
}


@pytest.mark.unit
@pytest.mark.parametrize("overrides", sorted(BAD))
def test_bad_pipeline_configs_are_refused_before_launch(overrides):
    cfg = load_config("configs/demo.yaml", ["parallel.tp=1", *overrides.split()])
    with pytest.raises(ConfigError, match=BAD[overrides].replace("[", r"\[").replace("]", r"\]")):
        validate(cfg, 4)


@pytest.mark.unit
def test_good_pipeline_configs_pass():
    for overrides in (["parallel.tp=2", "parallel.pp=2"],
                      ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.virtual_stages=2"],
                      ["parallel.tp=1", "parallel.pp=4", "parallel.pp_schedule=gpipe"],
                      ["parallel.tp=1", "parallel.pp=2", "parallel.pp_layers=[1,3]"]):
        validate(load_config("configs/demo.yaml", overrides), 4)


class CoalescedWork:
    """What torch's batch_isend_irecv returns on NCCL: one work for the whole group."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()  # each once: the gloo works inside would hang if waited for twice


def check_batched_exchange() -> list:
    """PipeComm's NCCL path, run on gloo with batch_isend_irecv stood in for by one that posts
    each op and returns, as torch does for NCCL, a single work for the group."""
    dist.batch_isend_irecv = lambda ops: [CoalescedWork([op.op(op.tensor, op.peer, tag=op.tag)
                                                         for op in ops])]
    ps = ParallelState.from_world(1, pipeline=ParallelConfig(pp=2))
    comm = PipeComm(ps.device)
    comm.batched = True
    peer = ps.stage_rank(ps.pp_rank + 1)
    sends = [Message(peer, k, tensor=torch.full((2,), 10.0 * ps.pp_rank + k)) for k in range(2)]
    recvs = [Message(peer, k, shape=torch.Size((2,)), dtype=torch.float32) for k in range(2)]
    received = [handle.wait().tolist() for handle in comm.exchange(sends, recvs)]
    comm.finish()
    return received


@pytest.mark.exactness
def test_the_nccl_exchange_gives_every_receive_its_tensor():
    assert run_distributed(check_batched_exchange, 2) == [[[10.0, 10.0], [11.0, 11.0]],
                                                          [[0.0, 0.0], [1.0, 1.0]]]
