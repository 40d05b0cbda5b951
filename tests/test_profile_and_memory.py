"""What the trainer reports about itself: the fullest rank's peak memory in every metrics record
and progress line, and a torch.profiler trace of the steps train.profile_steps names, on every
rank; a window that cannot be traced is refused before the run."""
import json
import resource

import pytest
import torch

from megalite.parallel.state import ParallelState
from megalite.run_config import load_config
from megalite.plan import validate
from megalite.training.metrics import peak_memory_bytes
from megalite.typed_config import ConfigError
from tests.support.harness import run_distributed
from tests.support.runs import common, losses, train_run

STEPS = 4


@pytest.mark.e2e
def test_a_tp2_run_traces_its_window_on_each_rank_and_logs_peak_memory(tmp_path, cache):
    run_dir = tmp_path / "run"
    train_run(2, common(cache, run_dir, "packed") + [
        "parallel.tp=2", f"train.max_steps={STEPS}", "train.profile_steps=[2,3]",
        "train.eval_tokens=32", "sample.max_new_tokens=1"])
    assert sorted(losses(run_dir, "peak_memory_gib")) == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == [
        "steps2-3_rank0.json", "steps2-3_rank1.json"]
    for rank in (0, 1):
        events = json.loads((run_dir / "profile" / f"steps2-3_rank{rank}.json").read_text())["traceEvents"]
        spans = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("name", "").startswith("optimizer step")}
        assert sorted(spans) == ["optimizer step 2", "optimizer step 3"]

        def inside(name: str) -> bool:  # an event of that name within a traced step
            return any(name in e.get("name", "") and any(a <= e["ts"] <= b for a, b in spans.values())
                       for e in events if "ts" in e)
        assert inside("aten::mm") or inside("aten::addmm")
        assert inside("all_reduce")  # TP's, in the steps themselves


def rank_peaks() -> tuple[float, float]:
    """(this rank's own peak RSS, what peak_memory_bytes reports) after rank 1 touches 256 MiB."""
    ps = ParallelState.from_world(1)
    if ps.dp_rank == 1:
        torch.ones(64 * 2**20)  # 256 MiB, written
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, peak_memory_bytes(ps)


@pytest.mark.e2e
def test_peak_memory_is_the_fullest_ranks():
    (own0, reported0), (own1, reported1) = run_distributed(rank_peaks, 2)
    assert reported0 == reported1 >= own1 > own0 + 200 * 2**20
    assert reported1 - own1 < 16 * 2**20  # rank 1's peak, not a sum


@pytest.mark.unit
@pytest.mark.parametrize("window", ["[0,2]", "[3,2]", "[2,5]"])
def test_a_window_outside_the_run_is_refused(window):
    cfg = load_config(None, [f"train.profile_steps={window}", f"train.max_steps={STEPS}"])
    with pytest.raises(ConfigError, match=r"train.profile_steps=\[.*\] must be \[first, last\]"):
        validate(cfg, 1)
