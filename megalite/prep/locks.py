"""File locks between the ranks of a run, and between runs sharing a cache or a prepare-data
output directory.

fcntl.flock locks belong to the open file: a process that dies, however it dies, releases them,
so a rank never waits forever for one that is gone. Ranks meet here before any collective exists,
so a long wait cannot trip a collective's timeout; it is announced instead, once.
"""
from __future__ import annotations

import fcntl
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

WAIT_NOTE_S = 5.0  # a wait longer than this says what it waits for (shorter ones stay silent)


@contextmanager
def lock_if_free(path: Path) -> Iterator[bool]:
    """Holds `path`'s lock and yields True if no one holds it; else yields False at once."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def lock_waiting(path: Path, waiting_for: str) -> Iterator[None]:
    """Holds `path`'s lock, waiting for it; a wait past WAIT_NOTE_S prints `waiting_for` (stderr)."""
    with open(path, "a") as f:
        note = threading.Timer(WAIT_NOTE_S, print, (waiting_for,), {"file": sys.stderr, "flush": True})
        note.daemon = True
        note.start()
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        finally:
            note.cancel()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
