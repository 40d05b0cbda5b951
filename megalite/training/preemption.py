"""Stop cleanly when the scheduler asks: SIGUSR1 (Slurm's --signal, ahead of the time limit) or
SIGTERM (preemption, scancel, a container stop); or the user: the first Ctrl-C (SIGINT) stops
the same way, and any signal after it at once, unsaved, with one line and status 130 (under
torchrun the second Ctrl-C reaches the agent, which passes it on as SIGTERM).

A handler only records the request; after each step the ranks agree (a MAX all-reduce, since
the signal reaches them at different moments), so all of them finish the same step, save the
same checkpoint and exit together. The agreement lags one step, so that it never makes the host
wait for the device (see `agreed`). The exit status PREEMPTED and the file RUN_DIR/PREEMPTED
tell the launcher (megalite/launch/sbatch.template) to requeue the job, which then resumes.
"""
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.cli import INTERRUPTED, mark_stopped
from megalite.parallel.state import ParallelState

PREEMPTED = 3  # exit status of a run that stopped early on request, with a checkpoint saved
MARKER = "PREEMPTED"


class StopRequest:
    """A context: the handlers are installed on entry (before the process group exists, so an
    early signal is not fatal) and the previous ones restored on exit."""

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)):
        self.requested = False
        self.signal_name = ""
        self.saved = False  # the stop's checkpoint is whole and the launcher told (the_stop_is_saved)
        self.signals = signals
        self._pending: torch.Tensor | None = None

    def __enter__(self) -> "StopRequest":
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.saved:
            os._exit(PREEMPTED)  # nothing left to stop: the checkpoint is whole
        if self.signal_name == "SIGINT":
            stop_now()
        if signum == signal.SIGINT and os.environ.get("RANK", "0") == "0":
            print("\nmegalite: Ctrl-C: stopping after this step with a checkpoint "
                  "(Ctrl-C again to stop at once, unsaved)", file=sys.stderr, flush=True)
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agreed(self, pstate: ParallelState) -> bool:
        """True on every rank, at the same call, once any rank had been asked to stop by the
        call before (a collective: every rank calls it after every step).

        The flag reduced now is read at the next call. On a GPU it travels back to a pinned
        host buffer behind the step just queued, and the next call waits for that copy only
        (an event), not for the step queued after it: the host stays a step ahead.
        """
        # A fill kernel: unlike a copy from the host, it does not wait for the device.
        flag = torch.full((1,), float(self.requested), device=pstate.device)
        if pstate.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        done = None
        if pstate.device.type == "cuda":
            flag = torch.empty(1, pin_memory=True).copy_(flag, non_blocking=True)
            done = torch.cuda.current_stream().record_event()
        previous, self._pending = self._pending, (flag, done)
        if previous is not None and previous[1] is not None:
            previous[1].synchronize()
        return previous is not None and bool(previous[0][0])


def stop_now() -> None:
    """The second Ctrl-C: out at once, from inside the handler. Unwinding could wait in a
    collective or on the checkpoint writer; what is on disk is whole either way (checkpoints
    and snapshots are renamed into place complete)."""
    if os.environ.get("RANK", "0") == "0":
        print("\nmegalite: interrupted: stopped at once, unsaved; train.resume=auto resumes "
              "from the last checkpoint", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(INTERRUPTED)


def mark_preempted(run_dir: Path, step: int, reason: str) -> str:
    """RUN_DIR/PREEMPTED for the launcher; returns the line that says so."""
    line = (f"stopped after step {step} on {reason} with a checkpoint; resume with "
            f"train.resume=auto (run.dir={run_dir})")
    (Path(run_dir) / MARKER).write_text(line + "\n")
    return line


def the_stop_is_saved(stop: StopRequest, rank: int) -> None:
    """This rank's checkpoint of the stop is whole: under `megalite torchrun` a mark that tells
    the launcher, which got the signal too, to exit PREEMPTED (launch/torchrun.py); and a
    signal from now on ends the rank as stopped, not as unsaved."""
    mark_stopped(rank)
    stop.saved = True


def clear_marker(run_dir: Path) -> None:
    (Path(run_dir) / MARKER).unlink(missing_ok=True)
