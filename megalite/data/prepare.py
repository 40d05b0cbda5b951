"""Pre-tokenize once into memory-mapped token files plus a document index, then reuse.

    cache_dir/<key>/ tokenizer.json, meta.json, {train,val}.bin (tokens), {train,val}.idx (offsets)

Each document is stored followed by eos; document i spans tokens [idx[i], idx[i+1]). The key
hashes the corpus bytes and every setting that changes the tokens, so a stale cache is never
reused. Built under a file lock, not a barrier: the first rank to arrive builds, the others
wait for the lock and read; a rank that fails releases the lock, and every other rank then
meets the same error itself, so no rank waits in a collective for one that died.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megalite.data.corpus import corpus_source, read_corpus
from megalite.data.tokenizer import TokenizerInfo, load_tokenizer, train_bpe
from megalite.run_config import DataConfig

FORMAT_VERSION = 1
SPLIT_SEED = 0  # the train/val split does not depend on run.seed: runs compare on one split


@dataclass
class TokenDocs:
    tokens: np.ndarray  # memory-mapped, every document followed by eos
    offsets: np.ndarray  # document i is tokens[offsets[i]:offsets[i + 1]]

    def __len__(self) -> int:
        return len(self.offsets) - 1


@dataclass
class PreparedData:
    tokenizer: TokenizerInfo
    train: TokenDocs
    val: TokenDocs
    meta: dict
    directory: Path


def prepare_data(cfg: DataConfig) -> PreparedData:
    key = _cache_key(cfg)
    root = Path(cfg.cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / key
    with _locked(root / f"{key}.lock"):
        if not (target / "meta.json").is_file():
            _build(cfg, target)
    data = _load(target)
    data.meta["cache_key"] = key
    return data


def _cache_key(cfg: DataConfig) -> str:
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{cfg.tokenizer}|{cfg.bpe_vocab_size}|{cfg.val_fraction}".encode())
    source = corpus_source(cfg.path)
    files = sorted(source.rglob("*.txt")) if source.is_dir() else [source]
    for f in files + ([Path(cfg.tokenizer)] if cfg.tokenizer != "bpe" else []):
        if f.is_file():
            h.update(f.name.encode())
            h.update(_file_digest(f))
    return h.hexdigest()[:16]


def _file_digest(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()


@contextmanager
def _locked(path: Path):
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(cfg: DataConfig, target: Path) -> None:
    corpus = read_corpus(cfg.path)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(corpus.documents))
    n_val = int(round(cfg.val_fraction * len(order))) if len(order) > 1 else 0
    n_val = min(max(n_val, 1 if cfg.val_fraction > 0 and len(order) > 1 else 0), len(order) - 1)
    val_docs = [corpus.documents[i] for i in sorted(order[:n_val])]
    train_docs = [corpus.documents[i] for i in sorted(order[n_val:])]

    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        if cfg.tokenizer == "bpe":
            train_bpe(train_docs, cfg.bpe_vocab_size).save(str(tmp / "tokenizer.json"))
        else:
            shutil.copy(cfg.tokenizer, tmp / "tokenizer.json")
        info = load_tokenizer(tmp / "tokenizer.json")
        dtype = np.uint16 if info.vocab_size <= 2**16 else np.uint32
        counts = {**_write_split(info, train_docs, tmp / "train", dtype),
                  **_write_split(info, val_docs, tmp / "val", dtype)}
        meta = {"format": FORMAT_VERSION, "source": corpus.source, "dtype": np.dtype(dtype).name,
                "vocab_size": info.vocab_size, "eos_id": info.eos_id, "bos_id": info.bos_id,
                "pad_id": info.pad_id, "skipped_empty_documents": corpus.skipped_empty,
                "documents_with_invalid_utf8": corpus.replaced_bytes_docs, **counts}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_split(info: TokenizerInfo, docs: list[str], stem: Path, dtype) -> dict:
    encoded = [e.ids + [info.eos_id]
               for e in info.tokenizer.encode_batch(docs, add_special_tokens=False)]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    tokens = np.fromiter((t for e in encoded for t in e), dtype=dtype, count=int(offsets[-1]))
    tokens.tofile(stem.with_suffix(".bin"))
    offsets.tofile(stem.with_suffix(".idx"))
    return {f"{stem.name}_documents": len(encoded), f"{stem.name}_tokens": int(offsets[-1])}


def main(argv: list[str]) -> int:
    """`megalite prepare-data --config CFG [data.key=value ...]`: build the cache ahead of a run."""
    import argparse

    from megalite.run_config import load_config
    parser = argparse.ArgumentParser(prog="megalite prepare-data", description=main.__doc__)
    parser.add_argument("--config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    data = prepare_data(load_config(args.config, args.overrides).data)
    print(json.dumps(data.meta, indent=1))
    return 0


def _load(target: Path) -> PreparedData:
    meta = json.loads((target / "meta.json").read_text())

    def split(name: str) -> TokenDocs:
        size = meta[f"{name}_tokens"]
        tokens = (np.memmap(target / f"{name}.bin", dtype=meta["dtype"], mode="r", shape=(size,))
                  if size else np.zeros(0, dtype=meta["dtype"]))
        return TokenDocs(tokens, np.fromfile(target / f"{name}.idx", dtype=np.int64))

    return PreparedData(load_tokenizer(target / "tokenizer.json"), split("train"), split("val"),
                        meta, target)
