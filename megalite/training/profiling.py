"""train.profile_steps=[first, last]: those optimizer steps traced by torch.profiler (as
Megatron's --profile-step-start / --profile-step-end). Each rank writes its Chrome trace to
run.dir/profile/steps{A}-{B}_rank{R}.json (chrome://tracing or ui.perfetto.dev), A..B the steps
it holds (a run stopped and resumed inside the window writes two); each traced step is a span
named `optimizer step N`, N as in metrics.jsonl. The trace runs on between the traced steps, so
it also holds their logging, evaluation and checkpoint starts."""
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class StepProfiler:
    def __init__(self, window: tuple[int, int] | None, run_dir: Path, rank: int, device: torch.device):
        self.window, self.run_dir, self.rank = window, run_dir, rank
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.tracing: profile | None = None
        self.steps: list[int] = []  # traced so far

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
        self.steps.append(n)
        if n == self.window[1]:
            self.close()

    def close(self) -> None:
        """Write the trace, if one is running (also where a run stops inside the window)."""
        if self.tracing is not None:
            tracing, self.tracing = self.tracing, None
            tracing.stop()
            if self.steps:
                name = f"steps{self.steps[0]}-{self.steps[-1]}_rank{self.rank}.json"
                path = self.run_dir / "profile" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                tracing.export_chrome_trace(str(path))

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            self.close()
        except Exception as failed:
            if kind is None:
                raise
            # The run's own error is the one to report.
            print(f"the profile trace was not written: {failed}", file=sys.stderr)
