"""Raw files given as a data path, prepared once into data.cache_dir/<key>/ by prepare-data's
streaming code, the key hashing the files and every setting that changes the tokens.

Built under a file lock, not a barrier: the first rank to arrive builds (saying so on stderr),
the others wait and read (saying what they wait for, past a few seconds); a rank that fails
releases the lock and the others meet the same error themselves, so no rank waits in a
collective for one that died. Raw inputs over RAW_IN_RUN_BYTES are refused inside a run, with the
prepare-data command that makes the same directory ahead of it.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from megalite.data.locks import lock_waiting
from megalite.data.prepare_shards import PrepareSettings, prepare_directory
from megalite.data.shard_facts import stat_key
from megalite.data.tokenizer import TokenizerInfo
from megalite.run_config import DataConfig
from megalite.typed_config import ConfigError

CACHE_VERSION = 2
# Raw input (bytes as stored) that a run prepares itself: about 5 minutes on one core at the 6.5
# MB/s prepare-data measures on 2 (docs/data.md). Beyond it the job would hold its devices idle
# for long (1T tokens: core-days), so it is prepared ahead with all of a node's cores.
RAW_IN_RUN_BYTES = 1e9


def prepared_in_cache(files: list[Path], cfg: DataConfig, given: TokenizerInfo | None,
                      in_run: bool, path: str) -> tuple[Path, str]:
    """(the directory, its key): `files` (data path `path`) prepared into data.cache_dir, or
    found there. in_run False: for `megalite prepare-data --config`, of any size."""
    settings = PrepareSettings(tokenizer=None if given is None else cfg.tokenizer,
                               eos_token=cfg.eos_token, workers=cfg.workers,
                               text_key=cfg.text_key, strict=cfg.strict,
                               bpe_vocab_size=cfg.bpe_vocab_size, bpe_sample_mb=cfg.bpe_sample_mb,
                               progress=False, chat_template=cfg.chat_template, train_on=cfg.train_on)
    tokenizer = "bpe" if given is None else given.digest
    chat = "" if cfg.chat_template is None else f"|{cfg.chat_template}|{cfg.train_on}"
    key = stat_key(files, f"v{CACHE_VERSION}|{tokenizer}|{settings.bpe_vocab_size}|"
                          f"{settings.bpe_sample_mb}|{settings.text_key}|{settings.strict}{chat}")[:16]
    root = Path(cfg.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / key
    size = sum(f.stat().st_size for f in files)
    if in_run and size > RAW_IN_RUN_BYTES and not (target / "meta.json").is_file():
        raise ConfigError(f"data path '{path}' is {size / 1e9:.1f} GB of raw files, more than a "
                          f"run prepares itself ({RAW_IN_RUN_BYTES / 1e9:g} GB, on one rank while "
                          f"the job holds its devices): prepare it ahead with all of a node's "
                          f"cores, `{_prepare_command(path, settings, target.resolve())}`, then "
                          f"train with data.path={target.resolve()} (or this data.path again: the "
                          f"run finds it prepared there)")
    rank = os.environ.get("RANK", "0")
    with lock_waiting(root / f"{key}.lock", f"data: rank {rank} waits for another rank "
                                            f"preparing data path '{path}' into {target}"):
        if not (target / "meta.json").is_file():
            print(f"data: rank {rank} prepares data path '{path}' ({len(files)} files, "
                  f"{size / 1e6:,.1f} MB) into {target}; the other ranks wait", file=sys.stderr,
                  flush=True)
            partial = root / f".{key}.partial"  # a killed build resumes here
            meta = prepare_directory(files, partial, settings)
            if meta["documents"] == 0:
                shutil.rmtree(partial, ignore_errors=True)
                raise ConfigError(f"data path '{', '.join(map(str, files))}' holds "
                                  f"no text ({meta['records']} records, {meta['empty']} empty, "
                                  f"{meta['not_json'] + meta['no_text']} without text): give it "
                                  f"at least one non-empty document")
            partial.rename(target)
    return target, key


def _prepare_command(path: str, settings: PrepareSettings, out: Path) -> str:
    """The prepare-data command making, into `out`, what this run would prepare."""
    args = ["megalite", "prepare-data", "--input", path, "--out", str(out),
            "--workers", str(os.cpu_count() or 1)]
    for flag, value in (("--tokenizer", settings.tokenizer), ("--eos-token", settings.eos_token)):
        args += [flag, value] if value is not None else []
    args += ["--text-key", settings.text_key] if settings.text_key != "text" else []
    args += ["--strict"] if settings.strict else []
    if settings.chat_template is not None:
        args += ["--chat-template", settings.chat_template, "--train-on", settings.train_on]
    if settings.tokenizer is None:
        args += ["--bpe-vocab-size", str(settings.bpe_vocab_size),
                 "--bpe-sample-mb", f"{settings.bpe_sample_mb:g}"]
    return shlex.join(args)
