"""`megalite torchrun [torchrun's arguments]`: torchrun, run in this process, with megalite's errors.

    megalite torchrun --nproc_per_node 4 -m megalite.train --config configs/demo.yaml

The same launch as `torchrun` with the same arguments, and the same output and exit status but
for megalite's own endings, each told in one line without torchrun's report of the failed and
stopped ranks or a traceback:
- bad input: a rank stops on a ConfigError (megalite's checks run on every rank before any
  collective): that rank's `megalite: error: ...` line once, exit status 2;
- a rank died: a survivor's line naming it (training/peers.py), exit status 1;
- Ctrl-C (or SIGTERM to the launcher): torchrun passes it to the ranks, which stop after a step
  with a checkpoint (training/preemption.py: rank 0 says so), exit status 3; a second Ctrl-C
  stops them at once, unsaved, exit status 130.
Plain torchrun prints rank 0's line, then its report or its signal's traceback, and exits 1.
"""
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from megalite.cli import ERROR_DIR, STOPPED
from megalite.failures import ERROR_PREFIX
from megalite.parallel.state import UNSHARED_STORE
from megalite.training.preemption import PREEMPTED

# Log "Sending process N closing signal SIGTERM" and "failed (exitcode: 2) local_rank: ...",
# and "Received SIGINT death signal, shutting down workers".
AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.agent.server.api")


class _QuietOnError(logging.Filter):
    """Lets torchrun's log lines through until a rank has left its error line, or the agent
    got a signal: the lines about stopping the ranks after it would only say again that a rank
    failed, or that the signal came."""

    def __init__(self, errors: Path):
        super().__init__()
        self.errors = errors
        # killed: the agent SIGKILLed ranks that had not stopped in its time.
        self.signalled = self.killed = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        self.signalled = self.signalled or "death signal" in message
        self.killed = self.killed or "forcefully exiting" in message
        if "closing signal" in message and not self.signalled:
            # The agent saw a rank fail and is about to stop the others: the survivors' lines
            # (a dead peer found by their next collective) are a moment behind.
            deadline = time.monotonic() + SETTLE_S
            while not any(self.errors.iterdir()) and time.monotonic() < deadline:
                time.sleep(0.05)
        return not (self.signalled or any(self.errors.iterdir()))


SETTLE_S = 3.0  # a survivor finds a dead peer within about a second (training/peers.py)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    sys.argv[0] = "megalite torchrun"  # the program torchrun's usage line names
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    with tempfile.TemporaryDirectory(prefix="megalite-errors-") as errors:
        quiet = _QuietOnError(Path(errors))
        os.environ[ERROR_DIR] = errors  # the ranks inherit it: cli.report_error writes there
        # Each round of the rendezvous gets a store of its own: the only way torchrun restarts
        # ranks across nodes (parallel/state.py: check_restartable).
        os.environ.setdefault(UNSHARED_STORE, "1")
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            torchrun(argv)
        except ChildFailedError:
            lines = sorted((p for p in Path(errors).iterdir() if p.name.isdigit()),
                           key=lambda p: int(p.name))
            if not lines:
                raise  # not megalite's: torchrun's own report and exit status
            status, line = lines[0].read_text().split(" ", 1)
            print(line, file=sys.stderr, flush=True)
            return int(status)
        except SignalException as sig:
            # The ranks got it from the agent: those that stopped with a checkpoint said so
            # (rank 0 prints the line); else they were stopped at once (a second Ctrl-C).
            if any(Path(errors).glob(f"{STOPPED}*")):
                return PREEMPTED
            if quiet.killed:
                print(f"{ERROR_PREFIX}the ranks did not stop with their checkpoint in torchrun's "
                      "--shutdown-timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default) and "
                      "were killed: raise it; train.resume=auto resumes from the last checkpoint",
                      file=sys.stderr, flush=True)
            return 128 + sig.sigval
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)
            del os.environ[ERROR_DIR]
    return 0
