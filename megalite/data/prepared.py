"""What a run trains on: data.path (or data.blend's paths) resolved into token documents.

A path is one of
  - a prepared directory (`megalite prepare-data --out DIR`): its shards and tokenizer;
  - a Megatron-LM prefix (PREFIX.bin + PREFIX.idx), with data.tokenizer the tokenizer it was
    made with (and data.eos_token, where its files do not name eos);
  - a glob of either (their shards joined in order);
  - raw files, directories or a glob of them (or "embedded"): prepared once into
    data.cache_dir, by a preparation process the run starts (data_for_run; prep/raw_cache.py);
  - "synthetic": random documents made in memory (Megatron's --mock-data).

Megatron data is checked against the tokenizer given (its largest token id, scanned once per
shard and cached: shard_facts.py), and padded mode counts the documents it will truncate from the
same cache, all before any collective. A run only reads: what the cache lacks is NotPrepared,
which `megalite prepare-data` (megalite/prep/) makes, ahead of the run or started by it.

Validation documents are data.val_path's, or a held-out fraction of each source chosen by
document number (evenly spread, the same for any sharding), read in place like the rest.
"""
import glob
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megalite.data.docs import ArrayShard, DocSet, TokenStore, held_out
from megalite.data.indexed import IndexedShard, bin_path, check_dtype_holds, idx_path, is_indexed
from megalite.data.record_counts import COUNT_KEYS, summed
from megalite.data.raw_files import EMBEDDED, SUPPORTED, expand_inputs
from megalite.data.shard_facts import known_facts, stat_key
from megalite.data.shuffle import key_of
from megalite.data.tokenizer import TokenizerInfo, load_tokenizer
from megalite.failures import ERROR_PREFIX
from megalite.run_config import DataConfig, to_dict
from megalite.typed_config import ConfigError

# The records skipped, summed over prepared directories' metas (Megatron data's: {}).
SKIPPED_KEYS = tuple(k for k in COUNT_KEYS if k not in ("records", "documents"))
SYNTHETIC = 0x5E  # the key of data.path=synthetic's hash
SYNTHETIC_MAX_BYTES = 2**31  # its tokens, held by every rank
FORMAT = "megalite-prepared"
RAW_CACHE_VERSION = 2
# Raw input (bytes as stored) that a run prepares itself: about 5 minutes on one core at the 6.5
# MB/s prepare-data measures on 2 (docs/data.md). Beyond it the job would hold its devices idle
# for long (1T tokens: core-days), so it is prepared ahead with all of a node's cores.
RAW_IN_RUN_BYTES = 1e9


@dataclass
class Source:
    name: str  # the path as the user wrote it
    weight: float  # normalised over the blend
    docs: DocSet


@dataclass
class PreparedData:
    tokenizer: TokenizerInfo
    train: list[Source]
    val: list[Source]  # data.val_path's, or each source's held-out documents (where it has some)
    meta: dict


class NotPrepared(Exception):
    """A part of the data the cache lacks (RawBuild, MissingFacts), raised by load_data for
    `megalite prepare-data` to make (prep/command.prepare_for_run)."""


@dataclass(eq=False)  # (exceptions: each equal to itself alone, and hashable)
class RawBuild(NotPrepared):
    """Raw files (data path `path`) to prepare into `target` in data.cache_dir."""
    files: list[Path]
    path: str
    target: Path

    def name(self) -> str:
        return f"data path '{self.path}' prepared into {self.target}"


@dataclass(eq=False)
class MissingFacts(NotPrepared):
    """Shards whose facts (shard_facts.py) the cache lacks."""
    shards: list
    max_id: bool
    longer_than: int | None

    def name(self) -> str:
        return (f"the facts of {len(self.shards)} shards ({bin_path(self.shards[0].prefix)}, ...; "
                f"largest id: {self.max_id}, longer than: {self.longer_than})")


@dataclass
class _Store:
    store: TokenStore
    # the prepared directory holding its tokenizer; None: data.tokenizer (Megatron data, or
    # synthetic data of the tokenizer given)
    tokenizer: Path | None
    key: str
    meta: dict


def data_for_run(cfg: DataConfig, tokenizer_from: str = "data.tokenizer") -> PreparedData:
    """The run's data, its missing parts prepared first by `megalite prepare-data` in a process
    of its own (the preparation's error is this call's): a training rank only reads."""
    for attempt in range(3):  # another node's preparation may race ours (prep/facts.py)
        try:
            return load_data(cfg, tokenizer_from=tokenizer_from)
        except NotPrepared as need:
            missing = need
        _prepare(cfg, tokenizer_from)
    raise ConfigError(f"data: {missing.name()} is still not prepared after 3 preparations: is "
                      f"something rewriting it while the run starts?")


def _prepare(cfg: DataConfig, tokenizer_from: str) -> None:
    """`megalite prepare-data --for-run` of the megalite this rank runs (-P: not one the current
    directory holds), its error line raised as this rank's."""
    command = [sys.executable, "-P", "-m", "megalite", "prepare-data", "--for-run",
               json.dumps({"data": to_dict(cfg), "tokenizer_from": tokenizer_from})]
    # Not the rank's launcher files: the preparation's error is the rank's to report.
    env = {k: v for k, v in os.environ.items() if k not in ("MEGALITE_ERROR_DIR", "TORCHELASTIC_ERROR_FILE")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env) as proc:
        error = None
        for line in proc.stderr:
            if line.startswith(ERROR_PREFIX):
                error = line[len(ERROR_PREFIX):].rstrip("\n")
            else:
                sys.stderr.write(line)
    if proc.returncode:
        raise ConfigError(error or f"data: `megalite prepare-data` preparing data path "
                                   f"'{cfg.path}' exited with status {proc.returncode}")


def load_data(cfg: DataConfig, in_run: bool = True,
              tokenizer_from: str = "data.tokenizer") -> PreparedData:
    """The data, read where it is prepared; what is not (yet) is raised (NotPrepared).
    in_run False: for `megalite prepare-data --config`, which prepares raw data of any size.
    tokenizer_from: the setting data.tokenizer came from, as errors name it."""
    entries = blend_entries(cfg)
    if not 0 <= cfg.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction} must be in [0, 1): the share of "
                          f"each source's documents held out for validation (0: none)")
    if cfg.val_path and Path(cfg.val_path).resolve() in {Path(p).resolve() for _, p in entries}:
        raise ConfigError(f"data.val_path '{cfg.val_path}' is also training data: validation "
                          f"would score documents the model trains on; give other data, or leave "
                          f"val_path empty to hold out data.val_fraction of each source")
    # data.tokenizer (a clear error if it is missing or unusable); None for bpe
    check_eos_token(None if cfg.tokenizer == "bpe" else cfg.tokenizer, cfg.eos_token)
    given = None if cfg.tokenizer == "bpe" else load_tokenizer(Path(cfg.tokenizer), cfg.eos_token)
    stores = [_resolve(path, cfg, given, in_run) for _, path in entries]
    val_store = _resolve(cfg.val_path, cfg, given, in_run) if cfg.val_path else None
    every = stores + ([val_store] if val_store else [])
    info = _one_tokenizer(every, [p for _, p in entries] + [cfg.val_path], given, tokenizer_from)
    for s, (_, path) in zip(every, entries + [(0, cfg.val_path)]):
        for shard in s.store.shards:
            check_dtype_holds(shard.dtype, info.vocab_size, f"data '{path}'")
    # Megatron data does not name its tokenizer: an id the given one lacks would train without
    # a word. Each shard's largest id is scanned once and cached. Prepared directories need no
    # scan: they carry the tokenizer they were made with.
    for shard, facts in _facts([s for s in every if s.tokenizer is None], cfg, max_id=True):
        if facts.max_id >= info.vocab_size:
            raise ConfigError(f"Megatron data '{bin_path(shard.prefix)}' holds token id "
                              f"{facts.max_id}, but data.tokenizer '{cfg.tokenizer}' has "
                              f"{info.vocab_size} tokens (ids 0..{info.vocab_size - 1}): give "
                              f"data.tokenizer=the tokenizer the data was made with")
    total = sum(w for w, _ in entries)
    train, val, dropped = [], [], [0]
    for (weight, path), s in zip(entries, stores):
        docs, held = held_out(s.store, cfg.val_fraction if val_store is None else 0)
        train.append(Source(path, weight / total, _within_rows(docs, cfg, path, dropped)))
        val += [Source(path, weight / total, _within_rows(held, cfg, path, dropped))] if len(held) else []
    if val_store is not None:
        val = [Source(cfg.val_path, 1.0, _within_rows(DocSet.whole(val_store.store), cfg,
                                                      cfg.val_path, dropped))]
    # Padded mode: the training sources' documents longer than a sample (seq_len + 1 tokens),
    # their held-out documents included (counted per shard and cached: no pass over documents).
    truncated = 0 if cfg.mode != "padded" or cfg.drop_longer else \
        sum(f.longer_than[cfg.seq_len + 1] for _, f in _facts(stores, cfg, longer_than=cfg.seq_len + 1))
    key = hashlib.sha256("|".join(s.key for s in every).encode()).hexdigest()[:16]
    return PreparedData(info, train, val, {"cache_key": key, **summary(info, train, val),
                                           **summed([s.meta for s in every], SKIPPED_KEYS),
                                           "truncated": truncated, "dropped": dropped[0]})


def _within_rows(docs: DocSet, cfg: DataConfig, path: str, dropped: list[int]) -> DocSet:
    """data.drop_longer: the documents that fit a row, the others counted in dropped[0]."""
    if not cfg.drop_longer or not len(docs):
        return docs
    kept = docs.no_longer_than(cfg.seq_len + 1)
    if not len(kept):
        raise ConfigError(f"data '{path}': all {len(docs)} documents are longer than a row "
                          f"(data.seq_len={cfg.seq_len} + 1 tokens), and data.drop_longer=true "
                          f"drops them: raise data.seq_len, or set data.drop_longer=false")
    dropped[0] += len(docs) - len(kept)
    return kept


def blend_entries(cfg: DataConfig) -> list[tuple[float, str]]:
    """data.blend's [weight, path] pairs, or data.path with weight 1."""
    if not cfg.blend:
        return [(1.0, cfg.path)]
    entries = []
    for i, item in enumerate(cfg.blend):
        ok = isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], str) \
            and isinstance(item[0], (int, float)) and not isinstance(item[0], bool) \
            and 0 < item[0] < math.inf
        if not ok:
            raise ConfigError(f"data.blend[{i}]={item!r}: each entry is [weight, path] with a "
                              f"finite weight > 0, e.g. data.blend=[[0.7, data/a], [0.3, data/b]]")
        entries.append((float(item[0]), item[1]))
    paths = [p for _, p in entries]
    if len(set(paths)) < len(paths):
        raise ConfigError(f"data.blend names a path twice ({paths}): list each once, with the "
                          f"sum of its weights")
    return entries


def summary(info: TokenizerInfo, train: list[Source], val: list[Source]) -> dict:
    """The content digest, what a resume compares: the tokenizer and each source's weight,
    documents and tokens (not the cache key, which holds the files' times and changes with
    every copy or clone); then the documents and tokens of each split."""
    sizes, parts = {}, [info.digest]
    for split, sources in (("train", train), ("val", val)):
        parts.append(",".join(f"{s.weight:.9g}:{len(s.docs)}:{s.docs.n_tokens}" for s in sources))
        sizes[f"{split}_documents"] = sum(len(s.docs) for s in sources)
        sizes[f"{split}_tokens"] = sum(s.docs.n_tokens for s in sources)
    return {"content": hashlib.sha256("|".join(parts).encode()).hexdigest()[:16], **sizes}


def _facts(stores: list[_Store], cfg: DataConfig, max_id: bool = False,
           longer_than: int | None = None) -> list[tuple]:
    """(shard, its Facts) for each shard of the stores; NotPrepared where the cache lacks some."""
    shards = [shard for s in stores for shard in s.store.shards]
    found, missing = known_facts(shards, cfg.cache_dir, max_id, longer_than)
    if missing:
        raise MissingFacts(missing, max_id, longer_than)
    return list(zip(shards, found))


def check_eos_token(tokenizer: str | None, eos_token: str | None) -> None:
    """An eos token names the end of document of a tokenizer given; none given (megalite's BPE)
    is refused, with data.tokenizer=bpe and with prepare-data without --tokenizer alike."""
    if eos_token is not None and tokenizer is None:
        raise ConfigError(f"eos token {eos_token!r} (data.eos_token, --eos-token) names the end "
                          f"of document of the tokenizer given (data.tokenizer, --tokenizer), and "
                          f"none is: megalite's BPE ends documents with <|eos|>, and prepared data "
                          f"keeps its own tokenizer's; give the tokenizer it belongs to, or leave "
                          f"the eos token unset")


def _resolve(path: str, cfg: DataConfig, given: TokenizerInfo | None, in_run: bool) -> _Store:
    if path == "embedded":
        return _raw([EMBEDDED], cfg, given, in_run, path)
    if path == "synthetic":
        return _synthetic(cfg, given, in_run)
    if not glob.has_magic(path) and not Path(path).exists() and not is_indexed(Path(path)):
        raise ConfigError(f"data path '{path}' does not exist: give raw files ({SUPPORTED}, a "
                          f"directory or a glob), a prepared directory, a Megatron .bin/.idx "
                          f"prefix (or a glob of them), embedded or synthetic")
    # A glob of Megatron data matches its .bin and .idx files: each pair is one prefix.
    matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    matches = list(dict.fromkeys(m[:-4] if m.endswith((".bin", ".idx")) and is_indexed(Path(m[:-4]))
                                 else m for m in matches))
    prepared = [Path(m) for m in matches if (Path(m) / "meta.json").is_file()]
    prefixes = [Path(m) for m in matches if is_indexed(Path(m))]
    if prepared or prefixes:
        others = [m for m in matches if Path(m) not in prepared + prefixes]
        if others or (prepared and prefixes):
            raise ConfigError(f"data path '{path}' matches prepared data and other things "
                              f"({', '.join((others or [str(prefixes[0])])[:5])}; an unfinished "
                              f"prepare-data leaves no meta.json): point it at one kind of data")
        if prepared:
            return _prepared(prepared)
        return _Store(TokenStore([IndexedShard(p) for p in prefixes]), None,
                      stat_key([f for p in prefixes for f in (idx_path(p), bin_path(p))]), {})
    return _raw(expand_inputs([path]), cfg, given, in_run, path)


def _prepared(directories: list[Path], key: str | None = None) -> _Store:
    """Prepared directories' shards; key: the store's (default: a hash of their meta.json)."""
    shards, metas, h = [], [], hashlib.sha256()
    for d in directories:
        text = (d / "meta.json").read_bytes()
        meta = json.loads(text)
        if meta.get("format") != FORMAT:
            raise ConfigError(f"'{d}/meta.json' is not megalite prepared data (format "
                              f"{meta.get('format')!r}): prepare it with megalite prepare-data")
        # A file without documents has its counts, but no shard (Megatron cannot map one).
        shards += [IndexedShard(d / s["name"]) for s in meta["shards"] if s["documents"]]
        metas.append(meta)
        h.update(hashlib.sha256(text).hexdigest().encode())
    if len({m["tokenizer"]["sha256"] for m in metas}) > 1:
        raise ConfigError(f"prepared directories {', '.join(map(str, directories))} were made "
                          f"with different tokenizers: join only data of one tokenizer")
    return _Store(TokenStore(shards), directories[0], key or h.hexdigest(), summed(metas, SKIPPED_KEYS))


def _raw(files: list[Path], cfg: DataConfig, given: TokenizerInfo | None, in_run: bool,
         path: str) -> _Store:
    """Raw files, read from their directory in data.cache_dir (NotPrepared until it is made):
    its key hashes the files (by name, size and time) and every setting that changes the tokens."""
    tokenizer = "bpe" if given is None else given.digest
    chat = "" if cfg.chat_template is None else f"|{cfg.chat_template}|{cfg.train_on}"
    key = stat_key(files, f"v{RAW_CACHE_VERSION}|{tokenizer}|{cfg.bpe_vocab_size}|"
                          f"{cfg.bpe_sample_mb}|{cfg.text_key}|{cfg.strict}{chat}")[:16]
    target = Path(cfg.cache_dir) / key
    if not (target / "meta.json").is_file():
        size = sum(f.stat().st_size for f in files)
        if in_run and size > RAW_IN_RUN_BYTES:
            raise ConfigError(f"data path '{path}' is {size / 1e9:.1f} GB of raw files, more than a "
                              f"run prepares itself ({RAW_IN_RUN_BYTES / 1e9:g} GB, on one rank while "
                              f"the job holds its devices): prepare it ahead with all of a node's "
                              f"cores, `{_prepare_command(path, cfg, target.resolve())}`, then "
                              f"train with data.path={target.resolve()} (or this data.path again: the "
                              f"run finds it prepared there)")
        raise RawBuild(files, path, target)
    return _prepared([target], key)


def _prepare_command(path: str, cfg: DataConfig, out: Path) -> str:
    """The prepare-data command making, into `out`, what this run would prepare."""
    args = ["megalite", "prepare-data", "--input", path, "--out", str(out),
            "--workers", str(os.cpu_count() or 1)]
    given = None if cfg.tokenizer == "bpe" else cfg.tokenizer
    for flag, value in (("--tokenizer", given), ("--eos-token", cfg.eos_token)):
        args += [flag, value] if value is not None else []
    args += ["--text-key", cfg.text_key] if cfg.text_key != "text" else []
    args += ["--strict"] if cfg.strict else []
    if cfg.chat_template is not None:
        args += ["--chat-template", cfg.chat_template, "--train-on", cfg.train_on]
    if given is None:
        args += ["--bpe-vocab-size", str(cfg.bpe_vocab_size), "--bpe-sample-mb", f"{cfg.bpe_sample_mb:g}"]
    return shlex.join(args)


def _synthetic(cfg: DataConfig, given: TokenizerInfo | None, in_run: bool) -> _Store:
    """data.synthetic_documents documents of random token ids, each ended by eos, of lengths
    uniform in [2, 2 seq_len] (so packed rows cross documents and padded rows pad), made in
    memory from a keyed hash of each position: the same on every rank, whatever its numpy.
    The tokenizer is the one given, or the embedded corpus's BPE."""
    n = cfg.synthetic_documents
    if n < 2:
        raise ConfigError(f"data.synthetic_documents={n} must be >= 2 (a training and a held-out "
                          f"document at least)")
    base = None if given is not None else _raw([EMBEDDED], cfg, None, in_run, "embedded")
    info = given or load_tokenizer(base.tokenizer)
    dtype = np.dtype(np.uint16 if info.vocab_size <= 2**16 else np.int32)
    size = n * (max(cfg.seq_len, 1) + 1) * dtype.itemsize
    if size > SYNTHETIC_MAX_BYTES:
        raise ConfigError(f"data.synthetic_documents={n} at data.seq_len={cfg.seq_len} is about "
                          f"{size / 2**30:.1f} GiB of tokens in every rank's memory (at most "
                          f"{SYNTHETIC_MAX_BYTES / 2**30:.0f}): lower data.synthetic_documents "
                          f"(its documents repeat each epoch, which a throughput run does not mind)")
    span = np.uint64(max(2 * cfg.seq_len - 1, 1))
    lengths = 2 + (key_of(SYNTHETIC, 0, np.arange(n)) % span).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = (key_of(SYNTHETIC, 1, np.arange(offsets[-1])) % np.uint64(info.vocab_size)).astype(dtype)
    tokens[offsets[1:] - 1] = info.eos_id
    key = hashlib.sha256(f"synthetic-v1|{n}|{cfg.seq_len}|{info.digest}".encode()).hexdigest()
    return _Store(TokenStore([ArrayShard(tokens, offsets)]), base and base.tokenizer, key, {})


def _one_tokenizer(stores: list[_Store], paths: list[str], given: TokenizerInfo | None,
                   given_by: str) -> TokenizerInfo:
    """The tokenizer every source was made with: data of two tokenizers cannot train together."""
    found = {}
    for s, path in zip(stores, paths):
        if s.tokenizer is None and given is None:
            raise ConfigError(f"data '{path}' is Megatron indexed data, which does not say its "
                              f"tokenizer: give data.tokenizer=the tokenizer it was made with (its "
                              f"tokenizer.json or Hugging Face directory)")
        info = given if s.tokenizer is None else load_tokenizer(s.tokenizer)
        found.setdefault(info.digest, (info, path))
    if given is not None:
        found.setdefault(given.digest, (given, given_by))
    if len(found) > 1:
        names = "; ".join(f"'{p}' ({t.file}, eos {t.names['eos_token']})" for t, p in found.values())
        fix = ("prepare the others again with it; with data.tokenizer=bpe each raw source trains "
               "its own BPE, so give data.tokenizer=a tokenizer" if given_by == "data.tokenizer" else
               f"{given_by}'s model reads its own tokenizer's ids: prepare the data again with "
               f"it (prepare-data --tokenizer), or give the raw files as data.path")
        raise ConfigError(f"the data was made with different tokenizers: {names}: train on data "
                          f"of one tokenizer ({fix})")
    return next(iter(found.values()))[0]
