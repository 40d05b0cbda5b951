"""Raw files given as a run's data path, prepared once into data.cache_dir/<key>/ (the key:
data/prepared._raw) by prepare-data's streaming code.

The preparations of a node take turns on a lock in its temporary directory: one builds (saying so
on stderr), the others then find it built, or meet the same error themselves. The lock only saves
work: each build writes a partial directory of its own (a temporary directory may be a job's, not
the node's, and other nodes share the cache), and the first whole one is renamed into place; a
later one that finds it there is dropped. A killed build's partial directory is left behind.
"""
import os
import shutil
import socket
import sys
import uuid

from megalite.data.prepared import RawBuild
from megalite.prep.locks import lock_waiting, node_lock
from megalite.prep.shards import PrepareSettings, prepare_directory
from megalite.run_config import DataConfig
from megalite.typed_config import ConfigError


def build_raw(need: RawBuild, cfg: DataConfig) -> None:
    target, rank = need.target, os.environ.get("RANK", "0")
    target.parent.mkdir(parents=True, exist_ok=True)
    with lock_waiting(node_lock(target), f"data: rank {rank} waits for another process "
                                         f"preparing data path '{need.path}' into {target}"):
        if (target / "meta.json").is_file():
            return
        size = sum(f.stat().st_size for f in need.files)
        print(f"data: rank {rank} prepares data path '{need.path}' ({len(need.files)} files, "
              f"{size / 1e6:,.1f} MB) into {target}; the other ranks wait", file=sys.stderr, flush=True)
        # (not mkdtemp: its mode would be 0700 whatever the umask, and the cache is shared)
        partial = target.parent / f".{target.name}.partial-{socket.gethostname()}-{uuid.uuid4().hex[:12]}"
        # (a run's data section names tokenizer "bpe" where prepare-data is given none)
        settings = PrepareSettings.named_in(cfg, tokenizer=None if cfg.tokenizer == "bpe" else cfg.tokenizer,
                                            progress=False)
        meta = prepare_directory(need.files, partial, settings, lock=node_lock(partial))
        if meta["documents"] == 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise ConfigError(f"data path '{', '.join(map(str, need.files))}' holds "
                              f"no text ({meta['records']} records, {meta['empty']} empty, "
                              f"{meta['not_json'] + meta['no_text']} without text): give it "
                              f"at least one non-empty document")
        try:
            partial.rename(target)
        except OSError:  # another node's preparation renamed its own first: the same data
            if not (target / "meta.json").is_file():
                raise
            shutil.rmtree(partial, ignore_errors=True)
