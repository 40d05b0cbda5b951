"""A rank SIGKILLed 5 times, at seeded random ranks and moments, on 2 nodes of 2 (TP2 x DP2):
each time the ranks restart from the newest in-memory snapshot, losing at most
train.snapshot_every steps, and the run ends as the uninterrupted one (one node's, 4 forked
ranks), bit for bit: every record and the final weights. So two nodes also train as one.
(benchmarks/recovery/ has the same measured on the demo's model, with the disk's path beside,
by a one-off script since removed: its README names the commit.)"""
import random
import re
import time

import pytest

from tests.support.nodes import Nodes
from tests.support.resume import assert_continues_exactly
from tests.support.runs import LAYOUT, STEPS, common

pytestmark = pytest.mark.e2e

KILLS, SNAPSHOT_EVERY, SEED = 5, 2, 0


def test_five_kills_each_recover_from_the_snapshot_bit_for_bit(tmp_path, cache, tp2dp2_padded):
    run_dir = tmp_path / "run"
    nodes = Nodes(tmp_path, common(cache, run_dir, "padded") + LAYOUT + [
        "train.checkpoint_every=0", f"train.snapshot_every={SNAPSHOT_EVERY}",
        "train.watchdog_s=60"],  # its heartbeat files say which step each rank finished
        max_restarts=KILLS)
    nodes.start("a")
    nodes.start("b")
    rng = random.Random(SEED)
    # After each: a step finished since the restart, then a moment into the next step.
    plan = [(step, rng.randrange(4), rng.uniform(0, 0.2))
            for step in sorted(rng.sample(range(3, STEPS - 1), KILLS))]
    beat, finished, old = run_dir / ".heartbeat" / "0", [], set()
    for step, rank, delay in plan:
        deadline = time.monotonic() + 120
        workers: dict = {}
        while time.monotonic() < deadline:  # every worker a new one: the last kill's are gone
            workers = nodes.workers()
            if len(workers) == 4 and not old & {p.pid for p in workers.values()}:
                break
            time.sleep(0.01)
        since = time.time()
        while time.monotonic() < deadline:  # a step finished by the new workers
            try:
                if beat.stat().st_mtime > since and int(beat.read_text()) >= step:
                    break
            except (OSError, ValueError):  # not yet written, or being replaced
                pass
            time.sleep(0.005)
        else:
            raise AssertionError(f"step {step} not reached after the restart: {nodes.wait()[-6000:]}")
        time.sleep(delay)
        finished.append(int(beat.read_text()))
        old = {p.pid for p in workers.values()}
        workers[rank].kill()
    out = nodes.wait()
    resumed = [int(s) for s in re.findall(r"resumed from the in-memory snapshot of step (\d+)", out)]
    assert len(resumed) == KILLS, out[-6000:]
    # In order (rank 0 prints them); rank 0 may note its step a moment after the others have
    # snapshotted it: at most one step ahead.
    for done, back in zip(finished, resumed):
        assert done - SNAPSHOT_EVERY <= back <= done + 1, (finished, resumed)
    assert_continues_exactly(run_dir, tp2dp2_padded, 0)  # every step's record, whichever run wrote it
