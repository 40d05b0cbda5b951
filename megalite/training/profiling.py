"""train.profile_steps=[first, last]: those optimizer steps traced by torch.profiler (as
Megatron's --profile-step-start / --profile-step-end). Each rank writes its Chrome trace to
run.dir/profile/rank{R}.json (chrome://tracing or ui.perfetto.dev); each traced step is a span
named `optimizer step N`, N as in metrics.jsonl."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

from megalite.parallel.state import ParallelState


class StepProfiler:
    def __init__(self, window: tuple[int, int] | None, run_dir: Path, ps: ParallelState):
        self.window, self.path = window, run_dir / "profile" / f"rank{ps.rank}.json"
        cuda = ps.device.type == "cuda"
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.tracing: profile | None = None

    @contextmanager
    def step(self, n: int):
        """Around optimizer step n (1-based); a resume inside the window traces what is left."""
        if self.window is None or not self.window[0] <= n <= self.window[1]:
            yield
            return
        if self.tracing is None:
            self.tracing = profile(activities=self.activities)
            self.tracing.start()
        with record_function(f"optimizer step {n}"):
            yield
        if n == self.window[1]:
            self.close()

    def close(self) -> None:
        """Write the trace, if one is running (also where a run stops inside the window)."""
        if self.tracing is not None:
            self.tracing.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.tracing.export_chrome_trace(str(self.path))
            self.tracing = None

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
