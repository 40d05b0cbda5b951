"""Facts about each shard that cost a pass over it, computed once ahead of a run and cached.

- its largest token id (a pass over the .bin): Megatron data does not name its tokenizer, and
  an id the given tokenizer lacks would otherwise train without a word (val_loss inf);
- how many of its documents are longer than L tokens (a pass over the index): padded mode's
  truncation note.

Each shard's facts live in <cache_dir>/shard-facts/<key>.json, the key hashing its .idx and .bin
by name, size and modification time (rewritten data is scanned again, nothing is read to key it).
A run only reads them: those missing are computed by the preparation (megalite/prep/facts.py).
Documents held in memory (data.path=synthetic) have no files to key a cache by: a run counts
their facts itself.
"""
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megalite.data.docs import ArrayShard
from megalite.data.indexed import bin_path, idx_path

VERSION = 1
SCAN_TOKENS = 64 << 20  # tokens per max(): bounded memory on a shard of any size
SCAN_DOCS = 1 << 22  # documents per pass over the index


@dataclass
class Facts:
    max_id: int | None = None  # the largest token id (-1: no tokens); None: not computed yet
    longer_than: dict[int, int] = field(default_factory=dict)  # L: documents of more than L tokens

    def holds(self, max_id: bool, longer_than: int | None) -> bool:
        return (self.max_id is not None or not max_id) and \
            (longer_than is None or longer_than in self.longer_than)


def stat_key(files: list[Path], settings: str = "") -> str:
    """Files by name, size and modification time: any rewrite changes the key, and no rank
    reads a whole corpus to compute it at every start."""
    h = hashlib.sha256(settings.encode())
    for f in files:
        stat = f.stat()
        h.update(f"|{f.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def facts_file(shard, cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "shard-facts" / \
        f"{stat_key([idx_path(shard.prefix), bin_path(shard.prefix)], f'v{VERSION}')[:32]}.json"


def read_facts(path: Path) -> Facts:
    if not path.is_file():
        return Facts()
    saved = json.loads(path.read_text())
    return Facts(saved.get("max_id"), {int(k): v for k, v in saved["longer_than"].items()})


def known_facts(shards: list, cache_dir: str | Path, max_id: bool = False,
                longer_than: int | None = None) -> tuple[list[Facts], list]:
    """(each shard's Facts, the shards whose facts asked for are not in the cache yet)."""
    # Documents in memory have no file to key a cache by: their facts are computed here.
    found = [computed(shard, Facts(), max_id, longer_than) if isinstance(shard, ArrayShard)
             else read_facts(facts_file(shard, cache_dir)) for shard in shards]
    return found, [shard for shard, facts in zip(shards, found) if not facts.holds(max_id, longer_than)]


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


def computed(shard, facts: Facts, max_id: bool, longer_than: int | None) -> Facts:
    """`facts` with those asked for and missing computed by a pass over the shard."""
    if max_id and facts.max_id is None:
        facts.max_id = largest_id(shard)
    if longer_than is not None and longer_than not in facts.longer_than:
        facts.longer_than[longer_than] = count_longer(shard, longer_than)
    return facts
