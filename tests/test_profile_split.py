"""The profiler's split (bench/profile.py) on synthetic events: user annotations never count as
kernel time, idle is taken against the unprofiled step (not the profiler's slower wall time),
and the rows sum to 1. The committed GPU results re-stated from their own JSON agree, and
docs/benchmarks.md shows exactly that table."""
import glob
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.profile import restate, restated_table, summarize

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
CUDA, CPU = SimpleNamespace(name="CUDA"), SimpleNamespace(name="CPU")


def event(key: str, device_ms: float, annotation: bool = False, device=CUDA):
    return SimpleNamespace(key=key, device_type=device, count=1, is_user_annotation=annotation,
                           self_device_time_total=device_ms * 1e3, self_cpu_time_total=0.0)


def test_annotations_are_not_kernel_time_and_idle_is_of_the_unprofiled_step():
    # Two steps: 60 ms of matmul, 20 of elementwise, 10 of the fused Adam kernel; the optimizer's
    # record_function range spans that kernel (10 ms on the device timeline); the profiled wall
    # time is 150 ms, the unprofiled step 50 ms.
    events = [event("nvjet_sm90_tst_256x128", 60), event("void at::native::elementwise_kernel", 20),
              event("void at::native::fused_adam_kernel", 10),
              event("Optimizer.step#AdamW.step", 10, annotation=True),
              event("aten::mm", 0.5, device=CPU)]  # host side: not a device kernel
    split = summarize(events, cuda=True, steps=2, wall_us=150e3, step_s=0.050)
    assert split["shares"] == {"matmul": 0.6, "elementwise": 0.2, "optimizer": 0.1, "idle": 0.1}
    assert split["kernel_ms_per_step"] == 45 and split["step_ms"] == 50
    assert "Optimizer.step#AdamW.step" not in {t["name"] for t in split["top"]}
    # Without the unprofiled time: of the profiled wall time, as before.
    assert summarize(events, True, 2, 150e3)["shares"]["idle"] == pytest.approx(0.4)
    # Kernels slower under the profiler than the whole unprofiled step: no idle, rows still 1.
    slow = summarize(events, True, 2, 150e3, step_s=0.040)["shares"]
    assert slow["idle"] == 0 and sum(slow.values()) == pytest.approx(1.0)


def peer_results() -> list[str]:
    return sorted(glob.glob(str(ROOT / "benchmarks" / "results" / "*-2026-11-26" / "peer-*.json")))


def test_committed_results_re_stated_from_their_json():
    import json
    h200 = json.loads((ROOT / "benchmarks/results/h200-2026-11-26/peer-llama-1b-2048-full.json").read_text())
    eager = next(r for r in h200["rows"] if r["system"] == "megalite" and not r["compile"])
    old, new = eager["profile"]["shares"], restate(eager["profile"], eager["step_s"])
    assert sum(old.values()) > 1.03  # the annotation counted besides the Adam kernel
    assert new["annotations"] == ["Optimizer.step#AdamW.step"]
    assert new["shares"]["optimizer"] == pytest.approx(old["optimizer"] / 2, abs=0.01)
    assert sum(new["shares"].values()) == pytest.approx(1.0)
    gpt2 = json.loads((ROOT / "benchmarks/results/h200-2026-11-26/peer-gpt2-small-1024-full.json").read_text())
    eager = next(r for r in gpt2["rows"] if r["system"] == "megalite" and not r["compile"])
    assert eager["profile"]["shares"]["idle"] > 0.2  # the profiler's own overhead, as written
    assert restate(eager["profile"], eager["step_s"])["shares"]["idle"] == 0  # kernels fill the step


def test_the_docs_show_the_re_stated_table():
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    paths = [str(Path(p).relative_to(ROOT)) for p in peer_results()]
    assert len(paths) == 5 and restated_table(paths) in docs
