"""File locks between preparations (never a training rank: they only read prepared data).

fcntl.flock locks belong to the open file: a process that dies, however it dies, releases them,
so no one waits forever for one that is gone. A run's preparations lock node-local files
(node_lock: in the temporary directory, not beside data on a shared file system, where locks are
the fragile part); preparations on several nodes meet only in atomic renames.
"""
import fcntl
import hashlib
import os
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

WAIT_NOTE_S = 5.0  # a wait longer than this says what it waits for (shorter ones stay silent)


def node_lock(path: Path) -> Path:
    """This node's lock file for `path` (which may be on a file system several nodes share)."""
    folder = Path(tempfile.gettempdir()) / f"megalite-locks-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    return folder / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]}.lock"


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
        finally:  # (not left to close(): a forked child holding the file would keep the lock)
            fcntl.flock(f, fcntl.LOCK_UN)
