"""In-memory snapshots' files: a rank killed while writing one leaves a temporary file that is
never read, and the ranks agree on the newest snapshot every rank has whole (the one before);
a file of another run or layout is not this run's; each rank's state comes back bit for bit;
a node lost with its memory restarts from its partners' copies. And a whole run: a rank
SIGKILLed under torchrun --max-restarts at PP2 x DP2 x EP2 restarts from the snapshot."""
from pathlib import Path

import pytest

import torch

from megalite.parallel.random import TensorParallelRNG, run_rng_state
from megalite.parallel.state import ParallelState
from megalite.training.snapshots import Snapshots
from tests.support.harness import run_distributed
from tests.support.resume import args, assert_continues_exactly, resumed_step, snapshot_restart, uninterrupted

pytestmark = pytest.mark.e2e


class Engine:
    """What Snapshots asks of an engine: masters (here the parameters) and AdamW-like state."""

    def __init__(self, model):
        self.state = {id(p): {"exp_avg": torch.randn_like(p)} for p in model.parameters()}
        self.loaded = {}

    def master(self, p):
        return p

    def optimizer_state(self, p):
        return self.state[id(p)]

    def load_optimizer_state(self, pairs, step):
        self.loaded = {id(p): (s, step) for p, s in pairs}


def linear(ps: ParallelState) -> torch.nn.Module:
    """A model as Snapshots sees one: its parameters, and its RNG to save and restore."""
    torch.manual_seed(ps.rank)
    model = torch.nn.Linear(3, 2)
    model.rng = TensorParallelRNG(ps.rank, ps.tp_rank)
    return model


def agree_after_a_torn_write(root: str) -> tuple:
    ps = ParallelState.from_world(1)  # DP2
    rank = ps.rank
    model = linear(ps)
    engine = Engine(model)
    snaps = Snapshots(Path(root), ps, {"run": "a"})
    rng = run_rng_state(model.rng)
    snaps.save(2, model, engine, rng, {"tokens": 20})
    snaps.save(4, model, engine, rng, {"tokens": 40})
    snaps.finish()
    if rank == 1:  # killed while writing step 4: its temporary file only
        snaps.path(4).unlink()
        snaps.path(4).with_name(f".{snaps.path(4).name}.tmp").write_bytes(b"half")
    torch.distributed.barrier()  # the ranks share the directory: each sees the torn file
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.rand(5)  # the generators move on
    restored = snaps.restore_newest(0, model, engine)
    same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    same_rng = torch.equal(torch.get_rng_state(), rng["cpu"])
    other = Snapshots(Path(root), ps, {"run": "b"}).newest_complete()
    newer_on_disk = snaps.restore_newest(2, model, engine)
    # Rank 0's whole file of step 4 is of the run before the restart: dropped.
    return (restored, same, same_rng, sorted(step for _, step in engine.loaded.values()), other,
            newer_on_disk, snaps.held())


def test_a_torn_snapshot_is_never_read_and_the_one_before_is_used(tmp_path):
    results = run_distributed(agree_after_a_torn_write, 2, str(tmp_path))
    for restored, same, same_rng, steps, other, newer_on_disk, held in results:
        assert restored == {"step": 2, "tokens": 20} and same and same_rng and steps == [2, 2]
        assert held == [(2, 0), (2, 1)]  # no file of a later step is kept to be mixed
        assert other is None  # another run's files (identity differs) are not this run's
        assert newer_on_disk is None  # a disk checkpoint as new: no snapshot to restore


def lose_a_node(root: str, case: str = "lost") -> tuple:
    """4 ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2), each node its own directory; after the
    step-4 snapshot, `case`:
    lost: the second node's memory is lost;
    torn: the first node's is lost, and the copy of rank 0's step 4 on the second node had been
      cut short (a temporary file only): step 4 is not whole anywhere for rank 0, so every rank
      takes step 2;
    swapped: the second node is replaced by a new one (an empty directory), which the launcher
      orders first: the surviving node's ranks are now 2 and 3, the new node's 0 and 1."""
    import os
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    ps = ParallelState.from_world(1)
    model = linear(ps)
    engine = Engine(model)
    node = Path(root) / f"node{ps.rank // 2}"
    snaps = Snapshots(node, ps, {"run": "a"})
    rng = run_rng_state(model.rng)
    snaps.save(2, model, engine, rng, {"tokens": 20})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    snaps.save(4, model, engine, rng, {"tokens": 40})
    snaps.finish()
    torch.distributed.barrier()
    if ps.rank == (0 if case == "torn" else 2):  # the node's memory is gone: its ranks' files
        for f in node.iterdir():                  # and the copies it kept (one rank empties it)
            f.unlink()
    if case == "torn" and ps.rank == 2:  # the copy it keeps of rank 0's step 4, cut short
        copy = snaps.path(4, rank=0)
        copy.unlink()
        copy.with_name(f".{copy.name}.tmp").write_bytes(copy.name.encode())  # as _publish leaves it
    torch.distributed.barrier()
    if case == "swapped":
        snaps = Snapshots(Path(root) / ("node1" if ps.rank < 2 else "node0"), ps, {"run": "a"})
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    restored = snaps.restore_newest(0, model, engine)
    same = all(torch.equal(saved[k], v) for k, v in model.state_dict().items())  # 2 and 4 equal
    return restored, same, snaps.partner


def test_a_node_lost_with_its_memory_restarts_from_its_partners_copies(tmp_path):
    results = run_distributed(lose_a_node, 4, str(tmp_path))
    assert [r[2] for r in results] == [2, 3, 0, 1]  # the same local rank of the other node
    for restored, same, _ in results:
        assert restored == {"step": 4, "tokens": 40} and same


def test_a_copy_cut_short_is_never_read_and_the_snapshot_before_is_used(tmp_path):
    for restored, same, _ in run_distributed(lose_a_node, 4, str(tmp_path), "torn"):
        assert restored == {"step": 2, "tokens": 20} and same


def test_a_replaced_node_ordered_first_restarts_from_the_files_wherever_they_are(tmp_path):
    """The files are found by rank, not by node: the surviving node's ranks load the copies it
    kept of their new ranks, and the new node's receive theirs from it."""
    for restored, same, _ in run_distributed(lose_a_node, 4, str(tmp_path), "swapped"):
        assert restored == {"step": 4, "tokens": 40} and same


def test_snapshots_restart_pp2_ep2_with_the_distributed_optimizer_bit_for_bit(tmp_path, cache):
    """4 ranks: PP2 x DP2 with the distributed optimizer in pure_bf16 (bf16 weights; each DP
    rank its rows of the fp32 masters and Adam state), an MoE layer on the second stage split
    EP2 over the DP ranks; a second-stage rank killed. The restarted run ends as the
    uninterrupted one, bit for bit."""
    layout = ["parallel.pp=2", "parallel.ep=2", "train.zero_stage=1", "model.dropout=0.0",
              "train.precision=pure_bf16",
              "model.mlp.activation=swiglu", "model.mlp.kind=moe", "model.mlp.experts=4", "model.mlp.top_k=2",
              "model.mlp.expert_ffn_hidden=32", "model.mlp.every=2", "train.micro_batch_size=2"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted(4, args(cache, whole, *layout))
    out = snapshot_restart(cache, killed, tmp_path / "shm", 4, layout, "SIGKILL", victim=3)
    assert_continues_exactly(killed, whole, resumed_step(out))


def test_snapshots_restart_adafactor_s_factors_bit_for_bit(tmp_path, cache):
    """4 ranks, TP2 x DP2 with the distributed optimizer and train.optimizer=adafactor (each
    rank its rows of the fp32 weights, every matrix's factors whole); a rank killed. The
    restarted run ends as the uninterrupted one, bit for bit."""
    layout = ["parallel.tp=2", "train.zero_stage=1", "model.dropout=0.0", "train.optimizer=adafactor",
              "train.adafactor.lr=0.1", "train.micro_batch_size=2"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted(4, args(cache, whole, *layout))
    out = snapshot_restart(cache, killed, tmp_path / "shm", 4, layout, "SIGKILL", victim=1)
    assert_continues_exactly(killed, whole, resumed_step(out))
