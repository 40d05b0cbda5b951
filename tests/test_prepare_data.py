"""`megalite prepare-data`: every input format, any worker count, bad input counted, and
documents that decode back to the input text (runs that die: test_prepare_recovery.py)."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megalite.data.docs import DocSet, TokenStore
from megalite.data.indexed import IndexedShard
from megalite.prep.shards import PrepareSettings, prepare_directory
from megalite.data.docs import held_out
from megalite.data.raw_files import expand_inputs
from megalite.data.tokenizer import load_tokenizer
from megalite.typed_config import ConfigError
from tests.support.data import TEXTS, tokenizer, write_inputs

ROOT = Path(__file__).resolve().parent.parent


def decoded(out: Path, info) -> list[list[str]]:
    meta = json.loads((out / "meta.json").read_text())
    result = []
    for shard in (s for s in meta["shards"] if s["documents"]):  # a file of none has no shard
        docs = DocSet.whole(TokenStore([IndexedShard(out / shard["name"])]))
        rows = docs.documents(np.arange(len(docs)), 10**9)
        assert all(r[-1] == info.eos_id for r in rows)
        result.append([info.decode(r[:-1].tolist()) for r in rows])
    return result


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [0, 2])
def test_every_format_decodes_back_to_its_input_text(tmp_path, workers):
    parts = write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    meta = prepare_directory(expand_inputs([str(tmp_path / "in")]), out,
                             PrepareSettings(tokenizer=str(tokenizer(tmp_path)), workers=workers,
                                             progress=False))
    info = load_tokenizer(out / "tokenizer.json")
    assert decoded(out, info) == list(parts.values())
    assert [s["documents"] for s in meta["shards"]] == [30] * 4
    assert meta["documents"] == 120 and meta["tokens"] == sum(s["tokens"] for s in meta["shards"])


@pytest.mark.e2e
def test_shards_are_the_same_for_any_worker_count_and_chunking(tmp_path, monkeypatch):
    write_inputs(tmp_path / "in")
    files = expand_inputs([str(tmp_path / "in")])
    tok = str(tokenizer(tmp_path))
    prepare_directory(files, tmp_path / "w0", PrepareSettings(tokenizer=tok, progress=False))
    monkeypatch.setattr("megalite.prep.sources.CHUNK_BYTES", 300)  # many chunks per file
    prepare_directory(files, tmp_path / "w2", PrepareSettings(tokenizer=tok, workers=2, progress=False))
    for f in sorted((tmp_path / "w0").glob("*.[bi][id]?")):
        assert f.read_bytes() == (tmp_path / "w2" / f.name).read_bytes(), f.name


@pytest.mark.unit
def test_bad_records_are_counted_by_file_and_line_and_nothing_is_lost(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine one"}\n'
                    b'this is not json\n'
                    b'{"txt": "wrong key"}\n'
                    b'\n'
                    b'{"text": "   "}\n'
                    b'{"text": 17}\n'
                    b'["a list"]\n'
                    + json.dumps({"text": "caf\udce9"}, ensure_ascii=False).encode("utf-8", "surrogateescape")
                    + b'\n{"text": "fine two"}\n')
    meta = prepare_directory([bad], tmp_path / "out",
                             PrepareSettings(tokenizer=str(tokenizer(tmp_path)), progress=False))
    (shard,) = meta["shards"]
    assert (shard["records"], shard["documents"], shard["empty"], shard["not_json"],
            shard["no_text"], shard["invalid_utf8"]) == (9, 3, 2, 1, 3, 1)
    assert shard["records"] == shard["documents"] + shard["empty"] + shard["not_json"] + shard["no_text"]
    assert shard["bad"] == ["line 2: not JSON (Expecting value)",
                            "line 3: no string field 'text' (its keys: txt)",
                            "line 6: no string field 'text' (its keys: text)",
                            "line 7: no string field 'text'"]
    info = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert decoded(tmp_path / "out", info) == [["fine one", "caf\ufffd", "fine two"]]
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not JSON \(Expecting value\); fix or drop it"):
        prepare_directory([bad], tmp_path / "strict",
                          PrepareSettings(tokenizer=str(tokenizer(tmp_path)), strict=True, progress=False))


@pytest.mark.unit
def test_parquet_without_the_text_column_names_its_columns(tmp_path):
    pq.write_table(pa.table({"id": ["1"], "content": ["hello"]}), tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match=r"'.*x\.parquet' has no column 'text' \(its columns: id, "
                                          r"content\): name the text column with --text-key"):
        prepare_directory([tmp_path / "x.parquet"], tmp_path / "out",
                          PrepareSettings(tokenizer=str(tokenizer(tmp_path)), progress=False))
    meta = prepare_directory([tmp_path / "x.parquet"], tmp_path / "out",
                             PrepareSettings(tokenizer=str(tokenizer(tmp_path)), text_key="content",
                                             progress=False))
    assert meta["documents"] == 1


def big_vocabulary_tokenizer(path: Path, size: int = 70_000) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<|eos|>": 0, "<|bos|>": 1, "<|pad|>": 2, **{f"w{i}": i + 3 for i in range(size - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.unit
def test_a_vocabulary_the_dtype_cannot_hold_is_refused(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "w1 w69000"}\n')
    tok = str(big_vocabulary_tokenizer(tmp_path / "big.json"))
    with pytest.raises(ConfigError, match=r"stores token ids as uint16 \(at most 65535\), but the "
                                          r"tokenizer has 70000 tokens"):
        prepare_directory([tmp_path / "x.jsonl"], tmp_path / "out",
                          PrepareSettings(tokenizer=tok, dtype="uint16", progress=False))
    meta = prepare_directory([tmp_path / "x.jsonl"], tmp_path / "auto",
                             PrepareSettings(tokenizer=tok, progress=False))
    assert meta["dtype"] == "int32"
    (row,) = decoded_ids(tmp_path / "auto")
    assert row.tolist() == [4, 69003, 0]


def decoded_ids(out: Path) -> list[np.ndarray]:
    shard = IndexedShard(out / json.loads((out / "meta.json").read_text())["shards"][0]["name"])
    docs = DocSet.whole(TokenStore([shard]))
    return docs.documents(np.arange(len(docs)), 10**9)


@pytest.mark.unit
def test_an_output_directory_of_another_tokenizer_is_refused(tmp_path):
    write_inputs(tmp_path / "in")
    files = expand_inputs([str(tmp_path / "in" / "a.jsonl.gz")])
    prepare_directory(files, tmp_path / "out", PrepareSettings(tokenizer=str(tokenizer(tmp_path)), progress=False))
    with pytest.raises(ConfigError, match=r"output directory '.*out' holds data of another tokenizer"):
        prepare_directory(files, tmp_path / "out",
                          PrepareSettings(tokenizer=str(tokenizer(tmp_path, 350)), progress=False))


@pytest.mark.unit
def test_a_file_without_the_text_key_is_an_error_naming_its_keys(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"body": "one", "id": 1}\n{"body": "two", "id": 2}\n')
    with pytest.raises(ConfigError, match=r"x\.jsonl': none of its 2 records has the text field "
                                          r"'text' \(line 1: no string field 'text' \(its keys: body, "
                                          r"id\)\): name the field with --text-key"):
        prepare_directory([tmp_path / "x.jsonl"], tmp_path / "out",
                          PrepareSettings(tokenizer=str(tokenizer(tmp_path)), progress=False))
    assert not list((tmp_path / "out").glob("00000-*"))


@pytest.mark.unit
def test_a_bpe_is_trained_again_only_where_no_shard_uses_it(tmp_path):
    """A re-run in the same directory: with other BPE settings it is refused once shards exist;
    after a first run that trained on nothing (a wrong --text-key), it trains afresh."""
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    files, out = [tmp_path / "x.jsonl"], tmp_path / "out"
    with pytest.raises(ConfigError, match=r"hold no document to train a BPE on \(120 records, 0 "
                                          r"empty, 120 without a text field 'text'\): .*--text-key"):
        prepare_directory(files, out, PrepareSettings(bpe_vocab_size=300, progress=False))
    meta = prepare_directory(files, out, PrepareSettings(bpe_vocab_size=300, text_key="body", progress=False))
    clean = prepare_directory(files, tmp_path / "clean",
                              PrepareSettings(bpe_vocab_size=300, text_key="body", progress=False))
    assert meta["tokens"] == clean["tokens"] and meta["tokenizer"] == clean["tokenizer"]
    assert prepare_directory(files, out, PrepareSettings(bpe_vocab_size=300, text_key="body",
                                                         progress=False)) == meta
    with pytest.raises(ConfigError, match=r"holds shards of a BPE trained with \{'bpe_vocab_size': 300.*"
                                          r"use a new output directory"):
        prepare_directory(files, out, PrepareSettings(bpe_vocab_size=350, text_key="body", progress=False))


@pytest.mark.unit
def test_held_out_documents_are_spread_by_number_and_independent_of_sharding(tmp_path):
    tok = str(tokenizer(tmp_path))
    whole, halves = tmp_path / "whole.jsonl", [tmp_path / "h1.jsonl", tmp_path / "h2.jsonl"]
    whole.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    halves[0].write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:50]))
    halves[1].write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[50:]))
    prepare_directory([whole], tmp_path / "one", PrepareSettings(tokenizer=tok, progress=False))
    prepare_directory(halves, tmp_path / "two", PrepareSettings(tokenizer=tok, progress=False))
    one, two = (TokenStore([IndexedShard(p.with_suffix("")) for p in sorted((tmp_path / d).glob("0*.idx"))])
                for d in ("one", "two"))
    assert len(two.shards) == 2
    (train_a, val_a), (train_b, val_b) = held_out(one, 0.1), held_out(two, 0.1)
    assert (len(train_a), len(val_a)) == (108, 12)
    assert np.array_equal(val_a.first, np.arange(12) * 10 + 5)
    for a, b in ((train_a, train_b), (val_a, val_b)):
        assert a.n_tokens == b.n_tokens
        assert np.array_equal(a.window([0], a.n_tokens)[0], b.window([0], b.n_tokens)[0])


@pytest.mark.e2e
def test_the_command_prepares_globs_and_files_then_trains_on_the_directory(tmp_path):
    write_inputs(tmp_path / "in")
    out = tmp_path / "prep"
    done = subprocess.run([sys.executable, "-m", "megalite", "prepare-data", "--input",
                           str(tmp_path / "in" / "*.jsonl.*"), str(tmp_path / "in" / "c.parquet"),
                           "--bpe-vocab-size", "300", "--out", str(out), "--workers", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["documents"] == 90
    assert "prepare" in done.stderr and "tok/s" in done.stderr  # the progress bar
    from tests.support.runs import common, train_run
    run = tmp_path / "run"
    train_run(1, common(str(tmp_path / "cache"), run, "packed") + [
        f"data.path={out}", "train.max_steps=2", "train.micro_batch_size=8"])
    assert (run / "checkpoints" / "step_00000002" / "meta.json").is_file()


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["truncated .zst", "truncated .gz", "corrupt .gz", "truncated .xz"])
def test_a_damaged_compressed_file_is_an_error_naming_it(tmp_path, damage):
    import lzma
    lines = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 20).encode()
    kind = damage.split()[1]
    packed = {".zst": zstandard.ZstdCompressor().compress, ".gz": gzip.compress,
              ".xz": lzma.compress}[kind](lines)
    broken = packed[: len(packed) // 2] if damage.startswith("truncated") else \
        packed[:40] + bytes(b ^ 0x55 for b in packed[40:80]) + packed[80:]
    path = tmp_path / f"x.jsonl{kind}"
    path.write_bytes(broken)
    with pytest.raises(ConfigError, match=r"x\.jsonl\.\w+' cannot be read to its end .*truncated or corrupt"):
        prepare_directory([path], tmp_path / "out",
                          PrepareSettings(tokenizer=str(tokenizer(tmp_path)), progress=False))
    assert not list((tmp_path / "out").glob("*.bin")) and not list((tmp_path / "out").glob(".*tmp"))


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["truncated", "corrupt page"])
def test_a_damaged_parquet_file_is_an_error_naming_it(tmp_path, damage):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"text": [f"{t} {i}" for i in range(40) for t in TEXTS]}), path,
                   row_group_size=len(TEXTS) * 10)
    packed = path.read_bytes()
    middle = len(packed) // 3  # inside the row groups' pages, far from the footer
    path.write_bytes(packed[: len(packed) // 2] if damage == "truncated" else
                     packed[:middle] + bytes(b ^ 0x55 for b in packed[middle:middle + 200])
                     + packed[middle + 200:])
    with pytest.raises(ConfigError, match=r"x\.parquet' cannot be read to its end .*truncated or corrupt"):
        prepare_directory([path], tmp_path / "out",
                          PrepareSettings(tokenizer=str(tokenizer(tmp_path)), progress=False))
    assert not list((tmp_path / "out").glob("*.bin")) and not list((tmp_path / "out").glob(".*tmp"))


@pytest.mark.unit
def test_odd_but_valid_records_are_kept_and_counted(tmp_path):
    """A BOM, CRLF endings, no final newline, a lone UTF-16 surrogate, a parquet null; a .txt
    ending in a separator (no record after it), an empty .txt (no record at all)."""
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "half \\ud83d pair"}\r\n'
                     b'{"text": "whole \\ud83d\\ude00 pair"}')
    pq.write_table(pa.table({"text": ["a row", None, "another row"]}), tmp_path / "nulls.parquet")
    (tmp_path / "ends.txt").write_text("one\n\n\ntwo\n\n\n")
    (tmp_path / "empty.txt").write_text("")
    meta = prepare_directory([path, tmp_path / "nulls.parquet", tmp_path / "ends.txt",
                              tmp_path / "empty.txt"], tmp_path / "out",
                             PrepareSettings(tokenizer=str(tokenizer(tmp_path)), progress=False))
    info = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert decoded(tmp_path / "out", info) == [["first", "half \ufffd pair", "whole \U0001F600 pair"],
                                               ["a row", "another row"], ["one", "two"]]
    odd, nulls, ends, empty = meta["shards"]
    assert (ends["records"], ends["documents"], ends["empty"]) == (2, 2, 0)
    assert (empty["records"], empty["documents"], empty["empty"]) == (0, 0, 0)
    assert (odd["records"], odd["documents"], odd["invalid_utf8"]) == (3, 3, 1)
    assert (nulls["records"], nulls["documents"], nulls["no_text"], nulls["bad"]) == \
        (3, 2, 1, ["row 1: 'text' is null"])


@pytest.mark.unit
def test_inputs_are_each_read_once_and_a_directory_names_what_it_skips(tmp_path, capsys):
    write_inputs(tmp_path / "in")
    (tmp_path / "in" / "notes.md").write_text("not data")
    (tmp_path / "in" / "E.JSONL").write_text('{"text": "upper case suffix"}\n')
    spelled = [str(tmp_path / "in" / "a.jsonl.gz"), str(tmp_path / "in" / "." / "a.jsonl.gz")]
    files = expand_inputs(spelled + [str(tmp_path / "in")])
    assert [f.name for f in files] == ["a.jsonl.gz", "E.JSONL", "b.jsonl.zst", "c.parquet", "d.txt"]
    err = capsys.readouterr().err
    assert "skipping 1 files" in err and "notes.md" in err


@pytest.mark.unit
def test_the_reader_keeps_a_bounded_number_of_chunks_in_flight(tmp_path, monkeypatch):
    """The memory bound: at most IN_FLIGHT_PER_WORKER x workers chunks submitted and not yet
    written, however long the file."""
    from megalite.prep import shards as prepare_shards, workers
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 10))
    monkeypatch.setattr("megalite.prep.sources.CHUNK_BYTES", 500)
    seen = {"submitted": 0, "written": 0, "most": 0}

    class CountingPool(workers.Workers):
        def __init__(self, workers, init):
            super().__init__(0, init[:-1] + (False,))  # in this process: not as a pool's worker

        def submit(self, *args):
            seen["submitted"] += 1
            seen["most"] = max(seen["most"], seen["submitted"] - seen["written"])
            return super().submit(*args)

    add = prepare_shards._Shard.add

    def counted_add(self, *args):
        seen["written"] += 1
        return add(self, *args)

    monkeypatch.setattr(workers, "Workers", CountingPool)
    monkeypatch.setattr(prepare_shards._Shard, "add", counted_add)
    prepare_directory([tmp_path / "long.jsonl"], tmp_path / "out",
                      PrepareSettings(tokenizer=str(tokenizer(tmp_path)), workers=3, progress=False))
    assert seen["submitted"] > 50 and seen["written"] == seen["submitted"]
    assert seen["most"] == prepare_shards.IN_FLIGHT_PER_WORKER * 3 + 1
