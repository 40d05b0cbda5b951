"""The shard facts a run needs and the cache lacks (data/shard_facts.py), computed and written.

Every rank's preparation walks the shards from its own offset (RANK of WORLD_SIZE, as torchrun
sets them), so the ranks of a node share the passes; a shard another process of this node is
scanning is waited for (a node-local lock: locks.py), then read. Preparations on other nodes
may scan the same shard: each writes its facts under a name of its own and renames it into place,
keeping those it finds there (a lost update is made again by the next preparation).
"""
import json
import os

from megalite.data.indexed import bin_path, write_atomic
from megalite.data.shard_facts import computed, facts_file, read_facts
from megalite.prep.locks import lock_waiting, node_lock


def write_missing_facts(shards: list, cache_dir: str, max_id: bool, longer_than: int | None) -> None:
    rank, world = int(os.environ.get("RANK", "0")), max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    start = rank * len(shards) // world
    for shard in shards[start:] + shards[:start]:
        path = facts_file(shard, cache_dir)
        with lock_waiting(node_lock(path), f"data: rank {rank} waits for another process "
                                           f"scanning shard {bin_path(shard.prefix)}"):
            facts = read_facts(path)
            if facts.holds(max_id, longer_than):
                continue
            facts = computed(shard, facts, max_id, longer_than)
            # Another node's preparation may have written other facts meanwhile: kept too.
            now = read_facts(path)
            facts.max_id = facts.max_id if facts.max_id is not None else now.max_id
            facts.longer_than = {**now.longer_than, **facts.longer_than}
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"shard": str(bin_path(shard.prefix)), "max_id": facts.max_id,
                                           "longer_than": {str(k): v for k, v in facts.longer_than.items()}}))
