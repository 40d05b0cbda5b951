"""What a run trains on: data.path (or data.blend's paths) resolved into token documents.

A path is one of
  - a prepared directory (`megalite prepare-data --out DIR`): its shards and tokenizer;
  - a Megatron-LM prefix (PREFIX.bin + PREFIX.idx), with data.tokenizer the tokenizer it was
    made with;
  - a glob of either (their shards joined in order);
  - raw files, directories or a glob of them (or "embedded"): prepared once into
    data.cache_dir/<key>/ by the same streaming code, the key hashing the files and every
    setting that changes the tokens. Built under a file lock, not a barrier: the first rank to
    arrive builds, the others wait and read; a rank that fails releases the lock and the others
    meet the same error themselves, so no rank waits in a collective for one that died.

Validation documents are data.val_path's, or a held-out fraction of each source chosen by
document number (evenly spread, the same for any sharding), read in place like the rest.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megalite.data.docs import DocSet, TokenStore
from megalite.data.indexed import IndexedShard, check_dtype_holds, idx_path, is_indexed
from megalite.data.pipeline import FORMAT, PrepareSettings, digest, prepare_directory
from megalite.data.sources import EMBEDDED, expand_inputs
from megalite.data.tokenizer import TokenizerInfo, load_tokenizer
from megalite.run_config import DataConfig
from megalite.typed_config import ConfigError

CACHE_VERSION = 2


@dataclass
class Source:
    name: str  # the path as the user wrote it
    weight: float  # normalised over the blend
    docs: DocSet


@dataclass
class PreparedData:
    tokenizer: TokenizerInfo
    tokenizer_path: Path
    train: list[Source]
    val: list[Source]  # data.val_path's, or each source's held-out documents (where it has some)
    meta: dict


@dataclass
class _Store:
    store: TokenStore
    tokenizer: Path | None
    key: str
    meta: dict


def prepare_data(cfg: DataConfig) -> PreparedData:
    entries = blend_entries(cfg)
    stores = [_resolve(path, cfg) for _, path in entries]
    val_store = _resolve(cfg.val_path, cfg) if cfg.val_path else None
    every = stores + ([val_store] if val_store else [])
    tokenizer_path = _one_tokenizer(every, [p for _, p in entries] + [cfg.val_path], cfg)
    info = load_tokenizer(tokenizer_path)
    for s, (_, path) in zip(every, entries + [(0, cfg.val_path)]):
        for shard in s.store.shards:
            check_dtype_holds(shard.dtype, info.vocab_size, f"data '{path}'")
    total = sum(w for w, _ in entries)
    train, val = [], []
    for (weight, path), s in zip(entries, stores):
        if val_store is None:
            docs, held = held_out(s.store, cfg.val_fraction)
            val += [Source(path, weight / total, held)] if len(held) else []
        else:
            docs = DocSet.whole(s.store)
        train.append(Source(path, weight / total, docs))
    if val_store is not None:
        val = [Source(cfg.val_path, 1.0, DocSet.whole(val_store.store))]
    key = hashlib.sha256("|".join(s.key for s in every).encode()).hexdigest()[:16]
    return PreparedData(info, tokenizer_path, train, val,
                        {"cache_key": key, **summary(train, val, [s.meta for s in every])})


def blend_entries(cfg: DataConfig) -> list[tuple[float, str]]:
    """data.blend's [weight, path] pairs, or data.path with weight 1."""
    if not cfg.blend:
        return [(1.0, cfg.path)]
    entries = []
    for i, item in enumerate(cfg.blend):
        ok = isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], str) \
            and isinstance(item[0], (int, float)) and not isinstance(item[0], bool) and item[0] > 0
        if not ok:
            raise ConfigError(f"data.blend[{i}]={item!r}: each entry is [weight, path] with a "
                              f"weight > 0, e.g. data.blend=[[0.7, data/a], [0.3, data/b]]")
        entries.append((float(item[0]), item[1]))
    return entries


def held_out(store: TokenStore, fraction: float) -> tuple[DocSet, DocSet]:
    """(train, val): round(fraction x documents) of them for validation (at least one when the
    fraction is positive and there are two or more), spread evenly over the document numbers."""
    n = store.n_docs
    n_val = min(max(int(round(fraction * n)), 1 if fraction > 0 else 0), n - 1) if n > 1 else 0
    val = ((np.arange(n_val) + 0.5) * n / max(n_val, 1)).astype(np.int64)
    train = DocSet(store, np.concatenate([[0], val + 1]), np.concatenate([val, [n]]))
    return train, DocSet(store, val, val + 1)


def summary(train: list[Source], val: list[Source], metas: list[dict]) -> dict:
    counts = {"train_documents": sum(len(s.docs) for s in train),
              "train_tokens": sum(s.docs.n_tokens for s in train),
              "val_documents": sum(len(s.docs) for s in val),
              "val_tokens": sum(s.docs.n_tokens for s in val)}
    for key in ("empty", "not_json", "no_text", "invalid_utf8"):
        counts[key] = sum(m.get(key, 0) for m in metas)
    return counts


def _resolve(path: str, cfg: DataConfig) -> _Store:
    if path == "embedded":
        return _raw([EMBEDDED], cfg)
    matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    if not glob.has_magic(path) and not Path(path).exists() and not is_indexed(Path(path)):
        raise ConfigError(f"data path '{path}' does not exist: give raw files (.jsonl, .jsonl.gz, "
                          f".jsonl.zst, .parquet, .txt, a directory or a glob), a prepared "
                          f"directory, a Megatron .bin/.idx prefix (or a glob of them), or embedded")
    # A glob of Megatron data matches its .bin and .idx files: each pair is one prefix.
    matches = list(dict.fromkeys(m[:-4] if m.endswith((".bin", ".idx")) and is_indexed(Path(m[:-4]))
                                 else m for m in matches))
    prepared = [Path(m) for m in matches if (Path(m) / "meta.json").is_file()]
    prefixes = [Path(m) for m in matches if is_indexed(Path(m))]
    if prepared and prefixes:
        raise ConfigError(f"data path '{path}' matches both prepared directories and Megatron "
                          f"prefixes: point it at one kind")
    if prepared:
        return _prepared(prepared)
    if prefixes:
        return _megatron(prefixes)
    return _raw(expand_inputs([path]), cfg)


def _prepared(directories: list[Path]) -> _Store:
    shards, metas, h = [], [], hashlib.sha256()
    for d in directories:
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ConfigError(f"'{d}/meta.json' is not megalite prepared data (format "
                              f"{meta.get('format')!r}): prepare it with megalite prepare-data")
        shards += [IndexedShard(d / s["name"]) for s in meta["shards"]]
        metas.append(meta)
        h.update(digest(d / "meta.json").encode())
    tokenizers = {d / "tokenizer.json" for d in directories}
    if len({m["tokenizer"]["sha256"] for m in metas}) > 1:
        raise ConfigError(f"prepared directories {', '.join(map(str, directories))} were made "
                          f"with different tokenizers: join only data of one tokenizer")
    counts = {k: sum(m[k] for m in metas) for k in ("empty", "not_json", "no_text", "invalid_utf8")}
    return _Store(TokenStore(shards), sorted(tokenizers)[0], h.hexdigest(), counts)


def _megatron(prefixes: list[Path]) -> _Store:
    h = hashlib.sha256()
    for p in prefixes:
        h.update(digest(idx_path(p)).encode())
    return _Store(TokenStore([IndexedShard(p) for p in prefixes]), None, h.hexdigest(), {})


def _raw(files: list[Path], cfg: DataConfig) -> _Store:
    settings = PrepareSettings(tokenizer=None if cfg.tokenizer == "bpe" else cfg.tokenizer,
                               workers=cfg.workers, text_key=cfg.text_key, strict=cfg.strict,
                               bpe_vocab_size=cfg.bpe_vocab_size, bpe_sample_mb=cfg.bpe_sample_mb,
                               progress=False)
    key = _cache_key(files, settings)
    root = Path(cfg.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / key
    with _locked(root / f"{key}.lock"):
        if not (target / "meta.json").is_file():
            partial = root / f".{key}.partial"  # a killed build resumes here
            meta = prepare_directory(files, partial, settings)
            if meta["documents"] == 0:
                shutil.rmtree(partial, ignore_errors=True)
                raise ConfigError(f"data path '{', '.join(map(str, files))}' holds "
                                  f"no text ({meta['records']} records, {meta['empty']} empty, "
                                  f"{meta['not_json'] + meta['no_text']} without text): give it "
                                  f"at least one non-empty document")
            partial.rename(target)
    store = _prepared([target])
    store.key = key
    return store


def _cache_key(files: list[Path], settings: PrepareSettings) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION}|{settings.tokenizer}|{settings.bpe_vocab_size}|"
                       f"{settings.bpe_sample_mb}|{settings.text_key}|{settings.strict}".encode())
    for f in files + ([Path(settings.tokenizer)] if settings.tokenizer else []):
        if f.is_file():
            h.update(f.name.encode())
            h.update(digest(f).encode())
    return h.hexdigest()[:16]


def _one_tokenizer(stores: list[_Store], paths: list[str], cfg: DataConfig) -> Path:
    """The tokenizer every source was made with: data of two tokenizers cannot train together."""
    given = None if cfg.tokenizer == "bpe" else Path(cfg.tokenizer)
    found = {}
    for s, path in zip(stores, paths):
        if s.tokenizer is None and given is None:
            raise ConfigError(f"data '{path}' is Megatron indexed data, which does not say its "
                              f"tokenizer: give data.tokenizer=the tokenizer.json it was made with")
        found.setdefault(digest(s.tokenizer or given), (s.tokenizer or given, path))
    if given is not None and given.is_file():
        found.setdefault(digest(given), (given, "data.tokenizer"))
    if len(found) > 1:
        names = "; ".join(f"'{p}' ({t})" for t, p in found.values())
        raise ConfigError(f"the data was made with different tokenizers: {names}: train on data "
                          f"of one tokenizer (prepare the others again with it; with "
                          f"data.tokenizer=bpe each raw source trains its own BPE, so give "
                          f"data.tokenizer=a tokenizer.json)")
    return next(iter(found.values()))[0]


@contextmanager
def _locked(path: Path):
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def main(argv: list[str]) -> int:
    """`megalite prepare-data --input PATH... --out DIR [--tokenizer tok.json] [--workers N]`, or
    `megalite prepare-data --config CFG [data.key=value ...]` to fill a run's cache ahead of it."""
    import argparse
    import os

    from megalite.run_config import load_config
    parser = argparse.ArgumentParser(prog="megalite prepare-data", description=main.__doc__)
    parser.add_argument("--input", nargs="+", help="files, directories or globs (quote them)")
    parser.add_argument("--out", help="the prepared directory (a re-run finishes what is missing)")
    parser.add_argument("--tokenizer", help="a tokenizer.json; without it a byte-level BPE is trained")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--strict", action="store_true", help="a bad record is an error, not counted")
    parser.add_argument("--bpe-vocab-size", type=int, default=4096)
    parser.add_argument("--bpe-sample-mb", type=float, default=100.0)
    parser.add_argument("--dtype", choices=("auto", "uint16", "int32"), default="auto")
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.input:
        if not args.out:
            raise ConfigError("--input needs --out DIR: where the prepared shards go")
        if args.workers < 0:
            raise ConfigError(f"--workers {args.workers} must be >= 0 (0: tokenize in this process)")
        settings = PrepareSettings(args.tokenizer, args.workers, args.text_key, args.strict,
                                   args.bpe_vocab_size, args.bpe_sample_mb, args.dtype)
        meta = prepare_directory(expand_inputs(args.input), Path(args.out), settings)
        print(json.dumps({k: v for k, v in meta.items() if k != "shards"}, indent=1))
        return 0
    data = prepare_data(load_config(args.config, args.overrides).data)
    print(json.dumps(data.meta, indent=1))
    return 0
