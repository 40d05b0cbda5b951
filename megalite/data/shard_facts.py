"""Facts about each shard that cost a pass over it, computed once and cached.

- its largest token id (a pass over the .bin): Megatron data does not name its tokenizer, and
  an id the given tokenizer lacks would otherwise train without a word (val_loss inf);
- how many of its documents are longer than L tokens (a pass over the index): padded mode's
  truncation note.

Each shard's facts live in <cache_dir>/shard-facts/<key>.json, the key hashing its .idx and .bin
by name, size and modification time (rewritten data is scanned again, nothing is read to key it).
No collective is needed and no rank works while the others wait: every rank walks the shards from
its own offset (RANK of WORLD_SIZE, as torchrun sets them), computes the shards whose facts are
missing under a per-shard file lock taken without waiting, skips those another rank is
computing, and at the end waits for those and reads their files. A rank that dies releases its
locks (locks.py), and the rank waiting then computes the shard itself. Documents held in memory
(data.path=synthetic) have no files to key a cache by: each rank computes their facts.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megalite.data.docs import ArrayShard
from megalite.data.indexed import bin_path, idx_path, write_atomic
from megalite.data.locks import lock_if_free, lock_waiting

VERSION = 1
SCAN_TOKENS = 64 << 20  # tokens per max(): bounded memory on a shard of any size
SCAN_DOCS = 1 << 22  # documents per pass over the index


@dataclass
class Facts:
    max_id: int | None = None  # the largest token id (-1: no tokens); None: not computed yet
    longer_than: dict[int, int] = field(default_factory=dict)  # L: documents of more than L tokens


def stat_key(files: list[Path], settings: str = "") -> str:
    """Files by name, size and modification time: any rewrite changes the key, and no rank
    reads a whole corpus to compute it at every start."""
    h = hashlib.sha256(settings.encode())
    for f in files:
        stat = f.stat()
        h.update(f"|{f.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def shard_facts(shards: list, cache_dir: str | Path, max_id: bool = False,
                longer_than: int | None = None) -> list[Facts]:
    """Each shard's Facts, holding its largest id (max_id) and its count of documents longer
    than `longer_than` tokens (when given): read from the cache, computed where missing."""
    if not shards:
        return []
    folder = Path(cache_dir) / "shard-facts"
    folder.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ.get("RANK", "0")), max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    n = len(shards)
    files = [None if isinstance(s, ArrayShard) else
             folder / f"{stat_key([idx_path(s.prefix), bin_path(s.prefix)], f'v{VERSION}')[:32]}.json"
             for s in shards]
    found: dict[int, Facts] = {}
    busy = []
    for i in ((rank * n // world + k) % n for k in range(n)):
        if files[i] is None:  # in memory: no file to key a cache by; each rank counts its own
            found[i] = _computed(shards[i], Facts(), max_id, longer_than)
            continue
        facts = _read(files[i])
        if _holds(facts, max_id, longer_than):
            found[i] = facts
            continue
        with lock_if_free(files[i].with_suffix(".lock")) as held:
            if held:
                found[i] = _complete(shards[i], files[i], max_id, longer_than)
            else:
                busy.append(i)
    for i in busy:
        with lock_waiting(files[i].with_suffix(".lock"),
                          f"data: rank {rank} waits for another rank scanning shard "
                          f"{bin_path(shards[i].prefix)}"):
            found[i] = _complete(shards[i], files[i], max_id, longer_than)
    return [found[i] for i in range(n)]


def largest_id(shard) -> int:
    """The shard's largest token id, -1 if it has no tokens."""
    tokens = shard.tokens
    return max((int(tokens[a:a + SCAN_TOKENS].max()) for a in range(0, len(tokens), SCAN_TOKENS)),
               default=-1)


def count_longer(shard, limit: int) -> int:
    """The shard's documents of more than `limit` tokens (lengths: differences of the starts)."""
    total = 0
    for a in range(0, len(shard), SCAN_DOCS):
        starts = shard.starts(np.arange(a, min(a + SCAN_DOCS, len(shard)) + 1))
        total += int((np.diff(starts) > limit).sum())
    return total


def _computed(shard, facts: Facts, max_id: bool, longer_than: int | None) -> Facts:
    """`facts` with those asked for and missing computed by a pass over the shard."""
    if max_id and facts.max_id is None:
        facts.max_id = largest_id(shard)
    if longer_than is not None and longer_than not in facts.longer_than:
        facts.longer_than[longer_than] = count_longer(shard, longer_than)
    return facts


def _read(path: Path) -> Facts:
    if not path.is_file():
        return Facts()
    saved = json.loads(path.read_text())
    return Facts(saved.get("max_id"), {int(k): v for k, v in saved["longer_than"].items()})


def _holds(facts: Facts, max_id: bool, longer_than: int | None) -> bool:
    return (facts.max_id is not None or not max_id) and \
        (longer_than is None or longer_than in facts.longer_than)


def _complete(shard, path: Path, max_id: bool, longer_than: int | None) -> Facts:
    """Under the shard's lock: its cached facts, with those asked for and missing computed and
    written (another rank may have written them since this one looked)."""
    facts = _read(path)
    if _holds(facts, max_id, longer_than):
        return facts
    facts = _computed(shard, facts, max_id, longer_than)
    write_atomic(path, json.dumps({"shard": str(bin_path(shard.prefix)), "max_id": facts.max_id,
                                   "longer_than": {str(k): v for k, v in facts.longer_than.items()}}))
    return facts
