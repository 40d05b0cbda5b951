"""What the trainer reports about itself: the fullest rank's peak memory in every metrics record
and progress line, and a torch.profiler trace of the steps train.profile_steps names, on every
rank; a window that cannot be traced is refused before the run."""
import json

import pytest

from megalite.run_config import load_config
from megalite.run_setup import validate
from megalite.typed_config import ConfigError
from tests.test_train import common, losses, train_run

STEPS = 4


def test_a_tp2_run_traces_its_window_on_each_rank_and_logs_peak_memory(tmp_path, cache):
    run_dir = tmp_path / "run"
    train_run(2, common(cache, run_dir, "packed") + [
        "parallel.tp=2", f"train.max_steps={STEPS}", "train.profile_steps=[2,3]",
        "train.eval_tokens=32", "sample.max_new_tokens=1"])
    peaks = losses(run_dir, "peak_memory_gib")
    assert sorted(peaks) == list(range(1, STEPS + 1))
    # CPU: the process's peak resident set, which only grows; tens of MiB at least (torch).
    values = [peaks[step] for step in sorted(peaks)]
    assert values == sorted(values) and values[0] > 0.05
    for rank in (0, 1):
        trace = json.loads((run_dir / "profile" / f"rank{rank}.json").read_text())
        names = [e.get("name", "") for e in trace["traceEvents"]]
        steps = sorted({n for n in names if n.startswith("optimizer step")})
        assert steps == ["optimizer step 2", "optimizer step 3"], steps
        assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names)
        assert any("all_reduce" in n for n in names)  # TP's collectives are in it


@pytest.mark.parametrize("window", ["[0,2]", "[3,2]", "[2,5]"])
def test_a_window_outside_the_run_is_refused(window):
    cfg = load_config(None, [f"train.profile_steps={window}", f"train.max_steps={STEPS}"])
    with pytest.raises(ConfigError, match=r"train.profile_steps=\[.*\] must be \[first, last\]"):
        validate(cfg, 1)
