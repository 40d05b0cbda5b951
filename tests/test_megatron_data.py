"""Megatron-LM's indexed format, both directions, against megatron-core's own reader and writer:
our shards load in its IndexedDataset, its files train here, and the same documents written by
either give the same training, step for step."""
import json
import warnings

import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")

from megalite.data.docs import DocSet, TokenStore  # noqa: E402
from megalite.data.indexed import IndexedShard  # noqa: E402
from megalite.prep.shards import PrepareSettings, prepare_directory  # noqa: E402
from megalite.prep.command import prepare_for_run  # noqa: E402
from megalite.data.tokenizer import load_tokenizer, train_bpe  # noqa: E402
from megalite.run_config import DataConfig  # noqa: E402
from megalite.typed_config import ConfigError  # noqa: E402
from tests.support.runs import common, losses, train_run  # noqa: E402

TEXTS = [f"Shard test {i}. " + "Pipelines split layers; tensors split matrices. " * (1 + i % 5)
         for i in range(160)]


@pytest.fixture
def prepared(tmp_path):
    """The same documents prepared by megalite (two files, so two shards) and by megatron-core's
    builder (one file, with eos appended as preprocess_data.py --append-eod does)."""
    tok = tmp_path / "tok.json"
    train_bpe(TEXTS, 400).save(str(tok))
    for i in range(2):
        (tmp_path / f"part{i}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[i * 80:(i + 1) * 80]))
    ours = tmp_path / "ours"
    prepare_directory([tmp_path / "part0.jsonl", tmp_path / "part1.jsonl"], ours,
                      PrepareSettings(tokenizer=str(tok), progress=False))
    info = load_tokenizer(tok)
    theirs = tmp_path / "theirs_text_document"
    builder = indexed_dataset.IndexedDatasetBuilder(f"{theirs}.bin", dtype=np.uint16)
    for text in TEXTS:
        ids = info.encode(text) + [info.eos_id]
        builder.add_document(np.array(ids), [len(ids)])
    builder.finalize(f"{theirs}.idx")
    return tok, ours, theirs, info


@pytest.mark.unit
def test_megatron_reads_our_shards(prepared):
    tok, ours, _, info = prepared
    meta = json.loads((ours / "meta.json").read_text())
    documents = iter(TEXTS)
    for shard in meta["shards"]:
        data = indexed_dataset.IndexedDataset(str(ours / shard["name"]))
        assert len(data) == shard["documents"] == 80
        assert data.index.dtype == np.uint16
        assert np.array_equal(data.document_indices, np.arange(81))
        for i in range(len(data)):
            assert data[i].tolist() == info.encode(next(documents)) + [info.eos_id]


@pytest.mark.unit
def test_we_read_megatron_files_as_megatron_does(prepared):
    _, _, theirs, _ = prepared
    data = indexed_dataset.IndexedDataset(str(theirs))
    docs = DocSet.whole(TokenStore([IndexedShard(theirs)]))
    assert len(docs) == len(data)
    ours = docs.documents(np.arange(len(docs)), 10**9)
    assert all(np.array_equal(ours[i], data[i]) for i in range(len(data)))


@pytest.mark.unit
def test_megatron_sentence_split_documents_read_whole(tmp_path):
    """Megatron data with several sequences (sentences) per document: a document is all of them."""
    prefix = tmp_path / "split"
    builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    builder.add_document(np.array([5, 6, 7, 8, 0]), [2, 3])
    builder.add_document(np.array([9, 0]), [2])
    builder.add_document(np.array([1, 2, 3, 0]), [1, 1, 2])
    builder.finalize(f"{prefix}.idx")
    docs = DocSet.whole(TokenStore([IndexedShard(prefix)]))
    assert [d.tolist() for d in docs.documents(np.arange(3), 100)] == [[5, 6, 7, 8, 0], [9, 0], [1, 2, 3, 0]]
    tokens, doc = docs.window([0], 11)
    assert tokens.tolist() == [[5, 6, 7, 8, 0, 9, 0, 1, 2, 3, 0]]
    assert doc.tolist() == [[0] * 5 + [1] * 2 + [2] * 4]


@pytest.mark.unit
def test_megatron_data_needs_its_tokenizer_and_one_that_fits_its_dtype(prepared, tmp_path):
    _, _, theirs, _ = prepared
    with pytest.raises(ConfigError, match=r"is Megatron indexed data, which does not say its "
                                          r"tokenizer: give data.tokenizer="):
        prepare_for_run(DataConfig(path=str(theirs), cache_dir=str(tmp_path / "cache")))
    small = tmp_path / "bytes"
    builder = indexed_dataset.IndexedDatasetBuilder(f"{small}.bin", dtype=np.uint8)
    builder.add_document(np.array([3, 4, 0]), [3])
    builder.finalize(f"{small}.idx")
    with pytest.raises(ConfigError, match=r"stores token ids as uint8 \(at most 255\), but the "
                                          r"tokenizer has 400 tokens"):
        prepare_for_run(DataConfig(path=str(small), tokenizer=str(prepared[0]),
                                cache_dir=str(tmp_path / "cache")))


@pytest.mark.exactness
@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_megatron_written_and_megalite_written_data_train_the_same(prepared, tmp_path, mode):
    tok, ours, theirs, _ = prepared
    base = common(str(tmp_path / "cache"), None, mode)[:-1] + [f"data.tokenizer={tok}",
                                                              "train.micro_batch_size=8"]
    train_run(1, base + [f"data.path={ours}", f"run.dir={tmp_path / 'a'}"])
    train_run(1, base + [f"data.path={theirs}", f"run.dir={tmp_path / 'b'}"])
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(la) == 10 and la == lb
    assert losses(tmp_path / "a", "val_loss") == losses(tmp_path / "b", "val_loss")


@pytest.mark.unit
@pytest.mark.parametrize("documents", [
    [[5, 0], [], [7, 8, 0]],  # an empty document in the middle (preprocess_data.py keeps them)
    [[5, 0], [7, 8, 0], []],  # and at the end
    [[5, 6, 7, 0], []],  # sentence-split, then empty: doc_index [0, 2, 2], as many sequences as documents
])
def test_megatron_empty_documents_read_as_megatron_reads_them(tmp_path, documents):
    prefix = tmp_path / "gaps"
    builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in documents:
        lengths = [2, len(doc) - 2] if len(doc) == 4 else ([len(doc)] if doc else [])
        builder.add_document(np.array(doc, dtype=np.int64), lengths)
    builder.finalize(f"{prefix}.idx")
    theirs = indexed_dataset.IndexedDataset(str(prefix))
    whole = [np.concatenate([theirs[s] for s in range(a, b)] or [np.zeros(0, np.uint16)]).tolist()
             for a, b in zip(theirs.document_indices[:-1], theirs.document_indices[1:])]
    assert whole == documents
    docs = DocSet.whole(TokenStore([IndexedShard(prefix)]))
    assert [d.tolist() for d in docs.documents(np.arange(len(docs)), 100)] == documents
    tokens, doc = docs.window([0], docs.n_tokens)
    assert tokens[0].tolist() == sum(documents, [])
    assert doc[0].tolist() == [i for i, d in enumerate(documents) for _ in d]


@pytest.mark.unit
def test_a_file_without_documents_leaves_no_shard_megatron_could_not_map(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "some text"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "  "}) + "\nnot json\n")
    tok = tmp_path / "tok.json"
    train_bpe(TEXTS, 300).save(str(tok))
    meta = prepare_directory([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "out",
                             PrepareSettings(tokenizer=str(tok), progress=False))
    assert [(s["documents"], s["empty"], s["not_json"]) for s in meta["shards"]] == [(1, 0, 0), (0, 1, 1)]
    assert not list((tmp_path / "out").glob("00001-*.bin"))
    for shard in (s for s in meta["shards"] if s["documents"]):
        assert len(indexed_dataset.IndexedDataset(str(tmp_path / "out" / shard["name"]))) == 1
    data = prepare_for_run(DataConfig(path=str(tmp_path / "out"), val_fraction=0.0,
                                   cache_dir=str(tmp_path / "cache")))
    assert (data.meta["train_documents"], data.meta["empty"], data.meta["not_json"]) == (1, 1, 1)


@pytest.mark.unit
def test_data_paths_that_cannot_be_read_as_one_kind_are_refused(prepared, tmp_path):
    tok, ours, theirs, _ = prepared
    (tmp_path / "unfinished").mkdir()  # a prepare-data killed before its meta.json
    with pytest.raises(ConfigError, match=r"matches prepared data and other things .*unfinished"):
        prepare_for_run(DataConfig(path=str(tmp_path / "*"), tokenizer=str(tok),
                                cache_dir=str(tmp_path / "cache")))
    with pytest.raises(ConfigError, match=r"tokenizer '.*typo\.json' not found: .* or data\.tokenizer=bpe"):
        prepare_for_run(DataConfig(path=str(theirs), tokenizer=str(tmp_path / "typo.json"),
                                cache_dir=str(tmp_path / "cache")))
    with pytest.raises(ConfigError, match=r"data\.blend names a path twice"):
        prepare_for_run(DataConfig(blend=[[1, str(ours)], [2, str(ours)]], cache_dir=str(tmp_path / "cache")))
    both = prepare_for_run(DataConfig(path=str(tmp_path / "theirs_*"), tokenizer=str(tok),
                                   cache_dir=str(tmp_path / "cache")))
    assert both.meta["train_documents"] + both.meta["val_documents"] == len(TEXTS)


@pytest.mark.unit
@pytest.mark.parametrize("cut", [".bin", ".idx"])
def test_a_truncated_shard_is_refused_naming_the_file(prepared, tmp_path, cut):
    """A half-copied file (a killed rsync): its documents must not read as garbage."""
    tok, _, theirs, _ = prepared
    damaged = tmp_path / f"theirs_text_document{cut}"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    with pytest.raises(ConfigError, match=rf"theirs_text_document\{cut}' is \d+ bytes.*truncated"):
        IndexedShard(theirs)
    with pytest.raises(ConfigError, match="truncated"):
        prepare_for_run(DataConfig(path=str(theirs), tokenizer=str(tok), cache_dir=str(tmp_path / "cache")))
