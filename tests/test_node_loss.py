"""A whole node lost (its torchrun agent, its workers and its shared memory): a new node joins
the rendezvous, its ranks receive their snapshot files from the copies the surviving node
kept, and the run ends as the uninterrupted one, bit for bit. Two agents on loopback stand for
two nodes (tests/support/nodes.py)."""
import re
import time

import pytest

from megalite.training.checkpoint_dirs import latest_checkpoint
from tests.support.nodes import Nodes
from tests.support.resume import assert_continues_exactly
from tests.support.runs import LAYOUT, STEPS, common

pytestmark = pytest.mark.e2e

SNAPSHOTS = ["train.checkpoint_every=0", "train.snapshot_every=2"]


def test_a_node_lost_with_its_memory_restarts_from_the_other_nodes_copies(tmp_path, cache,
                                                                          tp2dp2_padded):
    """TP2 x DP2 on 2 nodes of 2 ranks; once every file of the step-4 snapshot is on the first
    node (its ranks' and its copies of the second's), the second node is killed and a third
    takes its place with empty memory."""
    run_dir = tmp_path / "run"
    nodes = Nodes(tmp_path, common(cache, run_dir, "padded") + LAYOUT + SNAPSHOTS, max_restarts=1)
    nodes.start("a")
    nodes.start("b")
    deadline = time.monotonic() + 120
    while len(list(nodes.memory("a").glob("step_00000004.rank_*"))) < 4 \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    nodes.kill("b")
    nodes.start("c")
    out = nodes.wait()
    resumed = [int(s) for s in re.findall(r"resumed from the in-memory snapshot of step (\d+)", out)]
    assert len(resumed) == 1 and 4 <= resumed[0] < STEPS, out[-6000:]
    assert latest_checkpoint(run_dir).name == f"step_{STEPS:08d}"  # the only one on disk
    assert_continues_exactly(run_dir, tp2dp2_padded, resumed[0])
