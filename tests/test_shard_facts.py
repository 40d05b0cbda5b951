"""Per-shard facts (largest token id, documents longer than L) computed once by the preparation,
cached, split over ranks without collectives; foreign Megatron ids refused before any collective; raw corpora over
the in-run limit refused with the command to run instead."""
import json
import multiprocessing as mp
import os
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from megalite.data import prepared, shard_facts
from megalite.data.indexed import IndexedShard, ShardWriter, bin_path
from megalite.data.shard_facts import known_facts
from megalite.prep import command as prepare, locks
from megalite.prep.command import prepare_for_run
from megalite.prep.facts import write_missing_facts
from megalite.data.tokenizer import load_tokenizer, train_bpe
from megalite.run_config import DataConfig
from megalite.train import report_data
from megalite.typed_config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [f"Shard facts {i}: tensors split, pipelines stage, ranks agree. " * (1 + i % 3)
         for i in range(40)]


def facts_of(shards: list, cache: Path, max_id: bool = False, longer_than: int | None = None) -> list:
    """What a run reads after its preparation: the facts missing written, then all read."""
    write_missing_facts(shards, str(cache), max_id, longer_than)
    found, missing = known_facts(shards, cache, max_id, longer_than)
    assert not missing
    return found


def tokenizer(tmp_path) -> Path:
    path = tmp_path / "tok.json"
    train_bpe(TEXTS, 300).save(str(path))
    return path


def write_shards(folder: Path, count: int, top: int, seed: int = 0) -> tuple[list[Path], list]:
    """`count` Megatron shards of random documents (some empty) with ids below `top`; returns
    their prefixes and each shard's (tokens, lengths) as written."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    prefixes, written = [], []
    for i in range(count):
        lengths = rng.integers(0, 60, size=int(rng.integers(1, 40)))
        tokens = rng.integers(0, top, size=int(lengths.sum()))
        prefix = folder / f"part{i:03d}_text_document"
        writer = ShardWriter(prefix, np.uint16)
        writer.add(tokens, lengths)
        writer.finish()
        prefixes.append(prefix)
        written.append((tokens, lengths))
    return prefixes, written


@pytest.mark.unit
def test_an_id_beyond_the_tokenizers_vocabulary_is_refused_naming_the_shard(tmp_path):
    tok = tokenizer(tmp_path)
    vocab = load_tokenizer(tok).vocab_size
    prefixes, _ = write_shards(tmp_path / "data", 3, vocab)
    cfg = DataConfig(path=str(tmp_path / "data" / "part*"), tokenizer=str(tok),
                     cache_dir=str(tmp_path / "cache"))
    assert prepare_for_run(cfg).meta["train_documents"] > 0  # every id fits
    writer = ShardWriter(tmp_path / "data" / "part009_text_document", np.uint16)
    writer.add(np.array([3, vocab + 7, 1]), np.array([3]))
    writer.finish()
    with pytest.raises(ConfigError, match=rf"^Megatron data '.*part009_text_document\.bin' holds "
                                          rf"token id {vocab + 7}, but data.tokenizer '.*tok\.json' "
                                          rf"has {vocab} tokens .*give data.tokenizer=the tokenizer "
                                          rf"the data was made with$"):
        prepare_for_run(cfg)


@pytest.mark.e2e
def test_every_rank_exits_with_the_id_error_under_torchrun(tmp_path):
    from tests.support.runs import small_args
    tok = tokenizer(tmp_path)
    prefix = tmp_path / "bad_text_document"
    writer = ShardWriter(prefix, np.uint16)
    writer.add(np.arange(40) % 7 + 589, np.full(8, 5))
    writer.finish()
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "2",
         "--nproc_per_node", "2", "-m", "megalite.train",
         *small_args(tmp_path, prefix, f"data.tokenizer={tok}", "train.global_batch_size=4")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert out.count("holds token id 595, but data.tokenizer") >= 2, out
    assert time.monotonic() - start < 90


@pytest.mark.unit
def test_facts_equal_an_independent_count_and_are_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_facts, "SCAN_TOKENS", 7)  # many chunks: their seams are counted too
    monkeypatch.setattr(shard_facts, "SCAN_DOCS", 5)
    prefixes, written = write_shards(tmp_path / "data", 4, 500)
    shards = [IndexedShard(p) for p in prefixes]
    for limit in (0, 9, 30):
        got = facts_of(shards, tmp_path / "cache", max_id=True, longer_than=limit)
        assert [f.max_id for f in got] == [int(t.max()) for t, _ in written]
        assert [f.longer_than[limit] for f in got] == [int((n > limit).sum()) for _, n in written]
    monkeypatch.setattr(shard_facts, "largest_id", lambda shard: 1 / 0)
    monkeypatch.setattr(shard_facts, "count_longer", lambda shard, limit: 1 / 0)
    again = facts_of(shards, tmp_path / "cache", max_id=True, longer_than=9)
    assert [f.longer_than for f in again] == [{L: int((n > L).sum()) for L in (0, 9, 30)}
                                              for _, n in written]
    # A rewritten shard (another size and time) is scanned again.
    writer = ShardWriter(prefixes[0], np.uint16)
    writer.add(np.array([4, 2, 499, 1]), np.array([4]))
    writer.finish()
    with pytest.raises(ZeroDivisionError):
        facts_of([IndexedShard(prefixes[0])], tmp_path / "cache", max_id=True)


@pytest.mark.unit
def test_a_cache_built_by_one_layout_is_read_by_another(tmp_path, monkeypatch):
    """The facts are keyed by the shard's files alone: written by the ranks of a 4-rank run,
    read by every rank of a 2-rank run and by one process, none of which scans."""
    prefixes, written = write_shards(tmp_path / "data", 6, 300)
    shards = [IndexedShard(p) for p in prefixes]
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")
        facts_of(shards, tmp_path / "cache", max_id=True, longer_than=9)
    monkeypatch.setattr(shard_facts, "largest_id", lambda shard: 1 / 0)
    monkeypatch.setattr(shard_facts, "count_longer", lambda shard, limit: 1 / 0)
    for rank, world in ((0, 2), (1, 2), (0, 1)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        got = facts_of(shards, tmp_path / "cache", max_id=True, longer_than=9)
        assert [(f.max_id, f.longer_than[9]) for f in got] == \
            [(int(t.max()), int((n > 9).sum())) for t, n in written]


@pytest.mark.unit
def test_padded_runs_count_truncated_documents_from_the_cache(tmp_path, capsys):
    tok = tokenizer(tmp_path)
    prefixes, written = write_shards(tmp_path / "data", 3, load_tokenizer(tok).vocab_size)
    cfg = DataConfig(path=str(tmp_path / "data" / "part*"), tokenizer=str(tok),
                     mode="padded", seq_len=20, val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    data = prepare_for_run(cfg)
    lengths = np.concatenate([n for _, n in written])
    expected = int((np.diff(np.concatenate([[0], np.cumsum(lengths)])) > 21).sum())
    assert data.meta["truncated"] == expected > 0
    report_data(data)
    assert f"{expected} documents longer than data.seq_len were truncated (held-out documents " \
           f"included)" in capsys.readouterr().out
    assert prepare_for_run(replace(cfg, mode="packed")).meta["truncated"] == 0


def _rank(rank: int, shards: list[Path], cache: Path, ready, results) -> None:
    """One rank of the two-process test: its facts, and the shards it scanned itself."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    scanned, scan = [], shard_facts.largest_id

    def slow_scan(shard):
        scanned.append(shard.prefix.name)
        time.sleep(0.1)  # long enough that both ranks are at work at once
        return scan(shard)
    shard_facts.largest_id = slow_scan
    ready.wait()
    got = facts_of([IndexedShard(p) for p in shards], cache, max_id=True, longer_than=10)
    results.put((rank, scanned, [(f.max_id, f.longer_than[10]) for f in got]))


@pytest.mark.e2e
def test_two_ranks_share_the_scans_and_both_get_every_shards_facts(tmp_path):
    prefixes, written = write_shards(tmp_path / "data", 20, 1000)
    ctx = mp.get_context("fork")
    ready, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, prefixes, tmp_path / "cache", ready, results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    expected = [(int(t.max()), int((n > 10).sum())) for t, n in written]
    assert [facts for _, _, facts in got] == [expected, expected]
    scanned = [name for _, names, _ in got for name in names]
    assert sorted(scanned) == sorted(p.name for p in prefixes)  # each shard once, by one rank
    assert all(names for _, names, _ in got)  # both ranks did some


def _dies_scanning(shard: Path, cache: Path, scanning) -> None:
    def die(_):
        scanning.set()
        time.sleep(0.5)
        os._exit(1)
    shard_facts.largest_id = die
    facts_of([IndexedShard(shard)], cache, max_id=True)


@pytest.mark.e2e
def test_a_rank_dying_mid_scan_leaves_no_one_waiting(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(locks, "WAIT_NOTE_S", 0.1)
    (prefix,), [(tokens, _)] = write_shards(tmp_path / "data", 1, 1000)
    ctx = mp.get_context("fork")
    scanning = ctx.Event()
    dying = ctx.Process(target=_dies_scanning, args=(prefix, tmp_path / "cache", scanning))
    dying.start()
    assert scanning.wait(30)
    got = facts_of([IndexedShard(prefix)], tmp_path / "cache", max_id=True)
    dying.join(10)
    assert dying.exitcode == 1 and got[0].max_id == int(tokens.max())
    assert f"waits for another process scanning shard {bin_path(prefix)}" in capsys.readouterr().err


@pytest.mark.unit
def test_a_large_raw_corpus_is_refused_with_the_command_that_prepares_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prepared, "RAW_IN_RUN_BYTES", 1000)
    raw = tmp_path / "c.jsonl"
    raw.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    cfg = DataConfig(path=str(raw), bpe_vocab_size=300, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"is 0\.0 GB of raw files, more than a run prepares "
                                          r"itself \(1e-06 GB") as refused:
        prepare_for_run(cfg)
    command = str(refused.value).split("`")[1]
    argv = shlex.split(command)
    out = argv[argv.index("--out") + 1]
    assert argv[:4] == ["megalite", "prepare-data", "--input", str(raw)]
    assert argv[argv.index("--workers") + 1] == str(os.cpu_count() or 1)
    assert f"then train with data.path={out} " in str(refused.value)
    argv[argv.index("--workers") + 1] = "0"  # the same shards with any workers, and cheaper here
    assert prepare.main(argv[2:]) == 0
    capsys.readouterr()
    assert prepare_for_run(cfg).meta["cache_key"]  # this data.path now finds it prepared
    assert prepare_for_run(DataConfig(path=out, cache_dir=str(tmp_path / "cache"))).meta["train_tokens"] \
        == prepare_for_run(cfg).meta["train_tokens"]
    monkeypatch.setattr(prepared, "RAW_IN_RUN_BYTES", 1e9)
    prepare_for_run(DataConfig(path=str(raw), bpe_vocab_size=400, cache_dir=str(tmp_path / "cache")))
    assert f"data: rank 0 prepares data path '{raw}' (1 files" in capsys.readouterr().err
