"""Which shards of a prepared directory an earlier run left whole.

A shard holds the documents of one input file, or of consecutive ones (prepare-data
--shard-size-gb), and is named for its first; its marker, NNNNN-<name>.json, written last,
records the files it holds as they were read (name, size, modification time), the settings
that make its tokens, and its counts. A re-run keeps each shard whose files and settings are
unchanged and prepares the rest: resumable by input file, at the cost of redoing the whole
shard that a changed or unfinished file belongs to.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megalite.data.indexed import bin_path, is_indexed


def whole_shards(out: Path, files: list[Path], names: list[str],
                 made_with: dict) -> tuple[dict[int, dict], list[int]]:
    """({first file: record} of the shards an earlier run left whole, met walking the files in
    order, and the files, in order, that no such shard holds)."""
    kept, todo, i = {}, [], 0
    while i < len(files):
        record = _shard_done(out, names[i], files, i, made_with)
        if record is None:
            todo.append(i)
            i += 1
        else:
            kept[i] = record
            i += len(held_files(record))
    return kept, todo


def held_files(record: dict) -> list[dict]:
    """The input files a shard holds, as they were read: a one-file shard names its file
    inline (as before merging existed, so earlier directories stay whole)."""
    return record.get("sources") or [{key: record[key] for key in ("source", "bytes", "mtime_ns")}]


def _shard_done(out: Path, name: str, files: list[Path], first: int, made_with: dict) -> dict | None:
    """The record of shard `name` if an earlier run wrote it whole, with the settings of this
    run, from files `first`, `first` + 1, ... as they are now."""
    marker = out / f"{name}.json"
    if not marker.is_file():
        return None
    record = json.loads(marker.read_text())
    held = [(source["source"], source["bytes"], source["mtime_ns"]) for source in held_files(record)]
    now = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files[first:first + len(held)]]
    if held != now or any(record.get(k) != v for k, v in made_with.items()):  # (fewer files: unequal)
        return None
    prefix = out / name
    whole = not record["documents"] or (is_indexed(prefix) and bin_path(prefix).stat().st_size ==
                                         record["tokens"] * np.dtype(record["dtype"]).itemsize)
    return record if whole else None
