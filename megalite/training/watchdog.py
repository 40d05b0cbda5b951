"""A hung rank (stopped, not dead: SIGSTOP, a wedged driver) leaves its peers waiting in a
collective for the process group's timeout, half an hour; no launcher restarts what has not
failed. With train.watchdog_s=T each rank notes the step it has finished in a file of
RUN_DIR/.heartbeat (a shared filesystem, as checkpoints need) and a thread checks, once armed
by the first step, that its own rank finished one in the last T seconds. When not, it reads the
others' notes: the ranks furthest behind are the hung ones; those on this node are killed
(SIGKILL reaches a stopped process), and the rank says so in one line and exits, so that the
launcher restarts the ranks, from the in-memory snapshot (snapshots.py) or the disk.
"""
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from megalite.failures import ERROR_PREFIX
from megalite.training.peers import process_state
from megalite.training.snapshots import publish

WATCHDOG_EXIT = 1


class Watchdog:
    def __init__(self, limit_s: float, run_dir: Path, rank: int, table: list[tuple[str, int]],
                 host: str):
        """table: every rank's (host, pid) (peers.Peers)."""
        self.limit, self.rank, self.table, self.host = limit_s, rank, table, host
        self.beats = run_dir / ".heartbeat"
        self.beats.mkdir(parents=True, exist_ok=True)
        self.step: int | None = None
        self.last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def disarm(self, *exc) -> None:
        self._done.set()

    __exit__ = disarm

    def beat(self, step: int) -> None:
        """Step `step` is finished (or a long evaluation or save after it)."""
        self.step, self.last = step, time.monotonic()
        publish(self.beats / str(self.rank), str(step).encode())

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.limit / 4)):
            if self.step is not None and time.monotonic() - self.last > self.limit:
                self._stop()

    def _noted(self, rank: int) -> int:
        """The step `rank` noted last; -1 before its first (or a torn note)."""
        try:
            return int((self.beats / str(rank)).read_text())
        except (OSError, ValueError):
            return -1

    def _stop(self) -> None:
        steps = {rank: self._noted(rank) for rank in range(len(self.table))}
        behind = min(steps.values())
        # Behind the others, or stopped (here, where the process can be seen): the hung ones.
        hung = [r for r, s in steps.items() if (s == behind and s < max(steps.values())) or
                (self.table[r][0] == self.host and process_state(self.table[r][1]) == "T")]
        here = [r for r in hung if self.table[r][0] == self.host and r != self.rank]
        for r in here:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.table[r][1], signal.SIGKILL)
        who = (", ".join(f"rank {r} (pid {self.table[r][1]} on {self.table[r][0]}, after step "
                         f"{steps[r]})" for r in hung) + " hung" if hung else
               "no rank is behind or stopped here: a collective hangs")
        print(f"{ERROR_PREFIX}rank {self.rank}: no step finished in {self.limit:g} s after step "
              f"{self.step} (train.watchdog_s): {who}; {'killed, ' if here else ''}this rank stops so "
              f"that the launcher restarts the ranks (from the newest snapshot or checkpoint)",
              file=sys.stderr, flush=True)
        os._exit(WATCHDOG_EXIT)
