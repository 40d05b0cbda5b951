"""A text file cut into pieces at line boundaries, so that ranks can each read and tokenize
only their share of it (`megalite eval`), never the whole file.

Piece 0 starts at byte 0; piece k > 0 starts just after the first newline at or after byte
k * PIECE_BYTES, and each piece ends where the next starts. The pieces depend on the file
alone, never on the number of ranks. A cut follows a newline byte, which never occurs inside
a UTF-8 character, so no character is split; a line longer than PIECE_BYTES stays whole, and
a text with no newline is one piece. Piece k is empty when no newline lies in
[k * PIECE_BYTES, (k + 1) * PIECE_BYTES): it starts where piece k + 1 does.

Ranks own contiguous blocks of the nominal pieces (one per PIECE_BYTES). A rank finds its
first start by reading at most PIECE_BYTES from each nominal start of its block until one
holds a newline, then streams its pieces one at a time: it reads its own pieces plus at most
PIECE_BYTES per nominal piece of its block, never the whole file unless it owns all of it.
"""
import math
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

# Small enough that a text of a few MB is shared by the DP ranks (each scores only its pieces),
# large enough that windows restarting at a piece's start are a negligible share of them.
PIECE_BYTES = 1 << 20


def rank_pieces(path: Path, rank: int, ranks: int) -> Iterator[str]:
    """The non-empty pieces of a contiguous block of nominal pieces, the share of `rank` of
    `ranks`: read one at a time, in order, and decoded."""
    size = path.stat().st_size
    block = np.array_split(np.arange(math.ceil(size / PIECE_BYTES)), ranks)[rank]
    with open(path, "rb") as f:
        start = _first_start(f, block)
        while start is not None and start < size and _owner(start) <= block[-1]:
            f.seek(start)
            # Up to the next piece's nominal start, then the rest of the line that crosses it.
            piece = f.read((_owner(start) + 1) * PIECE_BYTES - start) + f.readline()
            yield piece.decode("utf-8", errors="replace")
            start += len(piece)


def _owner(start: int) -> int:
    """The piece starting at byte `start`: piece k > 0 starts in (k * PIECE_BYTES,
    (k + 1) * PIECE_BYTES] when not empty."""
    return max(math.ceil(start / PIECE_BYTES) - 1, 0)


def _first_start(f: BinaryIO, block: np.ndarray) -> int | None:
    """Where the block's first non-empty piece starts (None: all are empty), found by reading
    at most PIECE_BYTES from each nominal start until a newline."""
    for k in block.tolist():
        if k == 0:
            return 0
        f.seek(k * PIECE_BYTES)
        line = f.readline(PIECE_BYTES)
        if line.endswith(b"\n"):
            return k * PIECE_BYTES + len(line)
    return None
