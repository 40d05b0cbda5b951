"""`megalite torchrun [torchrun's arguments]`: torchrun, run in this process, with megalite's errors.

    megalite torchrun --nproc_per_node 4 -m megalite.train --config configs/demo.yaml

The same launch as `torchrun` with the same arguments, and the same output and exit status but
for bad input: when a rank stops on a ConfigError (megalite's checks run on every rank before
any collective), this prints that rank's `megalite: error: ...` line once, leaves out torchrun's
report of the failed and stopped ranks, and exits 2. Plain torchrun prints rank 0's line, then
its report (whose root cause names the same error), and exits 1, as it does for any failure.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from megalite.cli import ERROR_DIR, USAGE
from megalite.parallel.state import UNSHARED_STORE

# Logs "Sending process N closing signal SIGTERM" and "failed (exitcode: 2) local_rank: ...".
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _QuietOnError(logging.Filter):
    """Lets torchrun's log lines through until a rank has left its error line: the lines about
    stopping the ranks after it would only say again that a rank failed."""

    def __init__(self, errors: Path):
        super().__init__()
        self.errors = errors

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(self.errors.iterdir())


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    sys.argv[0] = "megalite torchrun"  # the program torchrun's usage line names
    logger = logging.getLogger(AGENT_LOGGER)
    with tempfile.TemporaryDirectory(prefix="megalite-errors-") as errors:
        quiet = _QuietOnError(Path(errors))
        os.environ[ERROR_DIR] = errors  # the ranks inherit it: cli.report_error writes there
        # Each round of the rendezvous gets a store of its own: the only way torchrun restarts
        # ranks across nodes (parallel/state.py: check_restartable).
        os.environ.setdefault(UNSHARED_STORE, "1")
        logger.addFilter(quiet)
        try:
            torchrun(argv)
        except ChildFailedError:
            lines = sorted((p for p in Path(errors).iterdir() if p.name.isdigit()),
                           key=lambda p: int(p.name))
            if not lines:
                raise  # not bad input: torchrun's own report and exit status
            print(lines[0].read_text(), file=sys.stderr, flush=True)
            return USAGE
        finally:
            logger.removeFilter(quiet)
            del os.environ[ERROR_DIR]
    return 0
