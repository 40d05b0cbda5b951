"""Many shards: a prepared corpus of 2,000 shards trains under `ulimit -n 1024` as its documents do
in one shard; a store holds no descriptor per shard, and reading every shard keeps at most
OPEN_SHARDS of them open; `prepare-data --shard-size-gb` merges small inputs into fewer shards
holding the same documents, and a re-run redoes only the shard of a changed file."""
import gc
import json
import os
import resource
import shutil

import numpy as np
import pytest

from megalite.data import indexed
from megalite.data.docs import DocSet, TokenStore
from megalite.data.indexed import OPEN_SHARDS, IndexedShard, ShardWriter
from megalite.prep.shards import PrepareSettings, prepare_directory
from megalite.prep.command import main as prepare_main
from megalite.data.tokenizer import train_bpe
from tests.support.data import write_jsonl
from tests.support.harness import run_distributed
from tests.support.runs import losses, run_train

SHARDS = 2000
FD_LIMIT = 1024  # the usual default: 2,000 shards opened at once would need 4,000 descriptors
TEXTS = [f"doc {i} {'of maps ' * (i % 3)}" for i in range(2 * SHARDS)]  # short: a cheap evaluation


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """(one, many): the same documents prepared as one shard, and split into SHARDS shards
    written directly (with meta.json as prepare-data writes it)."""
    root = tmp_path_factory.mktemp("many-shards")
    train_bpe(TEXTS, 300).save(str(root / "tok.json"))
    write_jsonl(root / "all.jsonl", TEXTS)
    one, many = root / "one", root / "many"
    meta = prepare_directory([root / "all.jsonl"], one, PrepareSettings(tokenizer=str(root / "tok.json"),
                                                                      progress=False))
    (record,) = meta["shards"]
    whole = DocSet.whole(TokenStore([IndexedShard(one / record["name"])]))
    lengths = whole.lengths(np.arange(len(whole)))
    tokens = whole.window([0], whole.n_tokens)[0][0]
    bounds = np.linspace(0, len(lengths), SHARDS + 1).astype(np.int64)
    ends = np.concatenate([[0], np.cumsum(lengths)])
    many.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(one / name, many / name)
    records = []
    saved_fsync = os.fsync
    os.fsync = lambda fd: None  # 4,000 fsyncs would take most of a minute on a disk
    try:
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            writer = ShardWriter(many / f"{k:05d}-part", np.dtype(meta["dtype"]))
            writer.add(tokens[ends[a]:ends[b]], lengths[a:b])
            writer.finish()
            records.append({"name": f"{k:05d}-part", "tokens": int(ends[b] - ends[a]),
                            "documents": int(b - a)})
    finally:
        os.fsync = saved_fsync
    (many / "meta.json").write_text(json.dumps({**meta, "shards": records}))
    return one, many


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def maps_under(folder) -> int:
    with open("/proc/self/maps") as f:
        return sum(str(folder) in line for line in f)


def many_shards(many) -> list[IndexedShard]:
    meta = json.loads((many / "meta.json").read_text())
    return [IndexedShard(many / s["name"]) for s in meta["shards"]]


@pytest.mark.unit
def test_a_store_of_many_shards_holds_none_open_and_reading_them_all_keeps_the_bound(corpora):
    one, many = corpora
    before = fds()
    shards = many_shards(many)
    store = TokenStore(shards)
    assert fds() == before and maps_under(many) == 0  # counts from the headers alone
    assert store.n_docs == len(TEXTS)
    for shard in shards:
        assert shard.tokens[0] >= 0 and shard.doc_of(np.array([0]))[0] == 0
    assert 0 < maps_under(many) <= 2 * OPEN_SHARDS
    assert fds() <= before + 2 * OPEN_SHARDS
    # Every shard read through the bound reads as the one shard holding the same documents.
    single = TokenStore(many_shards(one))
    positions = np.arange(single.token_base[-1])
    for got, want in zip(store.read(positions), single.read(positions)):
        np.testing.assert_array_equal(got, want)
    docs = np.arange(store.n_docs + 1)
    np.testing.assert_array_equal(store.starts(docs), single.starts(docs))


@pytest.mark.unit
def test_a_view_kept_past_its_shards_eviction_still_reads_and_its_map_closes_when_dropped(corpora):
    _, many = corpora
    shards = many_shards(many)
    view = shards[0].tokens
    first = view.copy()
    for shard in shards[1:OPEN_SHARDS + 2]:  # shard 0's maps are the least recent: evicted
        shard.tokens[0]
    assert shards[0] not in indexed._LRU.open
    np.testing.assert_array_equal(view, first)
    del view
    gc.collect()
    with open("/proc/self/maps") as f:
        assert not any(str(many / "00000-part.bin") in line for line in f)


def train_limited(argv: list[str]) -> int:
    """A rank allowed FD_LIMIT open files, as under `ulimit -n 1024`."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, hard))
    return run_train(argv)


@pytest.mark.exactness
def test_2000_shards_train_at_tp2_dp2_under_ulimit_1024_like_one_shard_at_one_process(corpora, tmp_path):
    one, many = corpora
    argv = ["model=tiny", "model.hidden=32", "model.dropout=0.0", "data.mode=packed",
            "data.seq_len=32", f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=3",
            "train.global_batch_size=8", "train.warmup_steps=1",
            # Every other document held out, all scored: the evaluation reads every shard.
            "data.val_fraction=0.5", "train.eval_tokens=0",
            "sample.prompts=[The]", "sample.max_new_tokens=2"]
    assert run_train(argv + [f"data.path={one}", "train.micro_batch_size=8",
                             f"run.dir={tmp_path / 'one'}"]) == 0
    assert run_distributed(train_limited, 4, argv + [f"data.path={many}", "parallel.tp=2",
                                                     "train.micro_batch_size=4",
                                                     f"run.dir={tmp_path / 'many'}"],
                           torchrun_env=True) == [0] * 4
    a, b = losses(tmp_path / "one"), losses(tmp_path / "many")
    assert sorted(a) == [1, 2, 3] and sorted(b) == sorted(a)
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * max(1.0, abs(a[step])), (step, a[step], b[step])
    val = losses(tmp_path / "one", "val_loss")
    assert val and val == pytest.approx(losses(tmp_path / "many", "val_loss"), rel=1e-5)


def merged(tmp_path, files, out, size_gb: float) -> dict:
    tok = tmp_path / "tok.json"
    if not tok.is_file():
        train_bpe(TEXTS[:200], 300).save(str(tok))
    assert prepare_main(["--input", *map(str, files), "--out", str(out), "--tokenizer", str(tok),
                         "--workers", "0", "--shard-size-gb", str(size_gb)]) == 0
    return json.loads((out / "meta.json").read_text())


def contents(out, meta) -> tuple:
    store = TokenStore([IndexedShard(out / s["name"]) for s in meta["shards"] if s["documents"]])
    docs = np.arange(store.n_docs + 1)
    return store.n_docs, store.starts(docs), store.read(np.arange(store.token_base[-1]))[0]


def same_contents(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])


@pytest.mark.unit
def test_shard_size_gb_merges_small_inputs_into_fewer_shards_of_the_same_documents(tmp_path):
    files = [tmp_path / f"in{i:02d}.jsonl" for i in range(12)]
    for i, f in enumerate(files):
        write_jsonl(f, TEXTS[i * 20:(i + 1) * 20] if i != 5 else [])  # one file of no document
    apart = merged(tmp_path, files, tmp_path / "apart", 0)
    size_gb = 3 * apart["shards"][0]["tokens"] * 2 / 1e9 * 0.9  # about three files a shard
    together = merged(tmp_path, files, tmp_path / "together", size_gb)
    assert len(apart["shards"]) == 12 and 3 <= len(together["shards"]) <= 5
    assert [s["source"] for s in together["shards"][0]["sources"]] == list(map(str, files[:3]))
    assert [s["documents"] for s in together["shards"][0]["sources"]] == [20, 20, 20]
    for key in ("documents", "tokens", "records", "empty"):
        assert together[key] == apart[key]
    same_contents(contents(tmp_path / "together", together), contents(tmp_path / "apart", apart))

    # A changed file: only the shard holding it is prepared again, and the directory holds
    # what a fresh run on the files as they are now gives.
    write_jsonl(files[7], TEXTS[:3])
    holder = next(s["name"] for s in together["shards"]
                  if str(files[7]) in [h["source"] for h in s["sources"]])
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "together").glob("0*-*.bin")}
    again = merged(tmp_path, files, tmp_path / "together", size_gb)
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "together").glob("0*-*.bin")}
    assert {n for n in before if before[n] != after.get(n)} == {f"{holder}.bin"}
    fresh = merged(tmp_path, files, tmp_path / "fresh", size_gb)
    same_contents(contents(tmp_path / "together", again), contents(tmp_path / "fresh", fresh))
    assert again["documents"] == fresh["documents"] == 10 * 20 + 3  # file 5 has none



@pytest.mark.unit
def test_the_index_search_equals_numpys_without_copying_the_index():
    from megalite.data.indexed import _search_right
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 1000):
        a = np.sort(rng.integers(0, 50, n))
        keys = rng.integers(-5, 60, 500)
        np.testing.assert_array_equal(_search_right(a, keys), np.searchsorted(a, keys, side="right"))
