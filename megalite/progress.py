"""Progress output that suits where it goes: a tqdm bar on a terminal, plain lines elsewhere.

A bar redraws its line with carriage returns, which a log file (a Slurm job's output, a pipe)
keeps as one line growing by the whole bar at every update, with whatever else is printed
glued to it. Off a terminal each update is a line of its own instead, at most one every
`every_s` seconds (the last one always).
"""
import sys
import time
from contextlib import contextmanager
from typing import Callable, TextIO


class Progress:
    """`show(position, text)` after each unit of work, `aside()` around anything else that
    prints, `close()` at the end. `label(position)` begins a plain line (e.g. "step 50/150");
    `bar` holds tqdm's options. A disabled one (another rank's) shows nothing."""

    def __init__(self, total: float, label: Callable[[float], str], file: TextIO | None = None,
                 every_s: float = 0.0, enabled: bool = True, **bar):
        self.file = sys.stdout if file is None else file
        self.total, self.label, self.every_s, self.enabled = total, label, every_s, enabled
        self.bar = None
        self.last_line = -float("inf")
        self.pending: str | None = None  # the newest plain line not printed yet
        if enabled and self.file.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=self.file, dynamic_ncols=True, **bar)

    def show(self, position: float, text: str) -> None:
        if self.bar is not None:
            self.bar.n = position
            self.bar.set_postfix_str(text, refresh=True)
        elif self.enabled:
            self.pending = f"{self.label(position)}: {text}"
            if time.monotonic() - self.last_line >= self.every_s or position >= self.total:
                self._flush()

    @contextmanager
    def aside(self):
        """A context in which other output goes to lines of its own, not into the bar's."""
        if self.bar is not None:
            self.bar.clear()
        try:
            yield
        finally:
            if self.bar is not None:
                self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.pending is not None:
            self._flush()

    def _flush(self) -> None:
        print(self.pending, file=self.file, flush=True)
        self.pending, self.last_line = None, time.monotonic()

