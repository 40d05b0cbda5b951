"""Stop cleanly when the scheduler asks: SIGUSR1 (Slurm's --signal, ahead of the time limit) or
SIGTERM (preemption, scancel, a container stop).

A handler only records the request; after each step the ranks agree (a MAX all-reduce, since
the signal reaches them at different moments), so all of them finish the same step, save the
same checkpoint and exit together. The exit status PREEMPTED and the file RUN_DIR/PREEMPTED
tell the launcher (launch/sbatch template) to requeue the job, which then resumes.
"""
from __future__ import annotations

import signal
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.parallel.state import ParallelState

PREEMPTED = 3  # exit status of a run that stopped early on request, with a checkpoint saved
MARKER = "PREEMPTED"


class StopRequest:
    """A context: the handlers are installed on entry (before the process group exists, so an
    early signal is not fatal) and the previous ones restored on exit."""

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        self.requested = False
        self.signal_name = ""
        self.signals = signals
        self.previous = {}

    def __enter__(self) -> "StopRequest":
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agreed(self, pstate: ParallelState) -> bool:
        """True on every rank if any rank has been asked to stop (a collective)."""
        flag = torch.tensor([float(self.requested)], device=pstate.device)
        if pstate.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def mark_preempted(run_dir: Path, step: int, reason: str) -> None:
    (Path(run_dir) / MARKER).write_text(f"stopped after step {step} on {reason}; resume with "
                                        f"train.resume=auto\n")


def clear_marker(run_dir: Path) -> None:
    (Path(run_dir) / MARKER).unlink(missing_ok=True)
