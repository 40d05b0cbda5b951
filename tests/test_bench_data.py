"""scripts/bench_data.py at a tiny size: the numbers it reports agree with each other and with
the prepared data (no timing is asserted: only that the accounting is right)."""
import csv
import importlib.util
import json
import os
from pathlib import Path

import pytest

from bench.provenance import megalite_of

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_data", ROOT / "scripts" / "bench_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_bench()


def test_tiny_run_is_consistent(bench, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    assert bench.main(["--out", str(out), "--work", str(work), "--sizes-mb", "2", "--workers", "1",
                       "--trainer-steps", "0", "--big-collate-steps", "3", "--no-raw-fast",
                       "--quiet-timeout", "0", "--retries", "0", "--code", "current"]) == 0
    for name in ("results.json", "results.csv", "data_prep.png", "README.md"):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert results["tokenizer"]["vocab_size"] == 8192
    assert results["git"]["commit"] and results["git"]["measured"] == "the working tree"
    assert results["device"]["logical_cores"] >= 1 and results["code_dir"] == str(ROOT)
    (size,) = results["sizes"]
    corpus, prep, raw = size["corpus"], size["prepare"], size["raw"]

    # The corpus: at least the size asked, written to the work dir, every line a document.
    path = Path(corpus["path"])
    assert path.parent == work and corpus["bytes"] == path.stat().st_size >= 2_000_000
    assert corpus["documents"] == len(path.read_bytes().splitlines())

    # prepare-data's counts are the prepared directory's.
    meta = json.loads((work / "prepared-2mb" / "meta.json").read_text())
    assert prep["returncode"] == 0 and prep["workers"] == 1
    assert prep["tokens"] == meta["tokens"] and prep["documents"] == meta["documents"] == corpus["documents"]
    assert prep["input_bytes"] == corpus["bytes"]
    assert prep["mb_per_s"] == pytest.approx(corpus["bytes"] / 1e6 / prep["wall_s"])
    assert prep["tokens_per_s"] == pytest.approx(meta["tokens"] / prep["wall_s"])
    assert prep["command"] in results["commands"] and "--workers 1" in prep["command"]

    # Memory covers the whole tree: the main process and its worker, summed.
    assert prep["peak_rss_bytes"] > 0 and prep["peak_pss_bytes"] > 0
    assert prep["max_processes_at_once"] >= 2
    assert prep["peak_rss_children_bytes_at_peak"] > 0 and prep["peak_rss_main_bytes_at_peak"] > 0
    assert prep["peak_rss_bytes"] == prep["peak_rss_main_bytes_at_peak"] + prep["peak_rss_children_bytes_at_peak"]
    assert prep["peak_rss_bytes"] <= prep["sum_of_each_process_peak_rss_bytes"]
    assert prep["peak_rss_main_bytes_at_peak"] <= prep["main_process_peak_rss_bytes"] < prep["peak_rss_bytes"]
    assert any("spawn_main" in name for name in prep["process_peak_rss_bytes"])

    # Raw encode_batch saw the same documents: its tokens plus one eos each are the shards'.
    assert raw["whole_corpus"] and raw["measured_bytes"] == corpus["bytes"]
    assert raw["documents"] == meta["documents"]
    assert raw["encode_batch"]["tokens"] + raw["documents"] == meta["tokens"]
    assert size["tokens_check"]["equal"]
    assert size["prepare_over_raw_mb_s"] == pytest.approx(prep["mb_per_s"] / raw["encode_batch"]["mb_per_s"])

    # Goals are computed from these numbers; the collate ran on the prepared data.
    goal = results["goals"]["peak_rss_at_largest"]
    assert goal["value_bytes"] == prep["peak_rss_bytes"] and goal["pass"] == (prep["peak_rss_bytes"] <= 1.5e9)
    assert results["goals"]["throughput_2mb"]["value"] == size["prepare_over_raw_mb_s"]
    collates = results["collate"]
    assert set(collates) == {"2MB prepared, padded", "2MB prepared, packed"}
    for c in collates.values():
        assert c["steps"] == 3 and c["seq_len"] == 1024 and c["global_batch"] == 32
        assert 0 < c["median_step_s"] and c["mean_target_tokens_per_step"] > 0
    assert collates["2MB prepared, packed"]["mean_target_tokens_per_step"] <= 32 * 1024

    rows = list(csv.DictReader(open(out / "results.csv")))
    assert {"section", "case", "metric", "value", "unit"} == set(rows[0])
    by = {(r["section"], r["metric"]): r["value"] for r in rows if r["case"] == "2MB"}
    assert int(by[("prepare", "tokens")]) == meta["tokens"]
    assert int(by[("prepare", "peak_rss_bytes")]) == prep["peak_rss_bytes"]
    readme = (out / "README.md").read_text()
    assert "python scripts/bench_data.py --out benchmarks/data-prep" in readme and "| 2 MB |" in readme

    # A second run reuses the corpus (same bytes) and prepares afresh into an emptied directory.
    again = bench.make_corpus(path, 2_000_000)
    assert again["reused"] and again["bytes"] == corpus["bytes"]


def test_step_times_from_metrics(bench, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "tokens": 100, "tokens_per_s": 10.0},
               {"step": 2, "tokens": 300, "tokens_per_s": 100.0},
               {"step": 2, "val_loss": 1.0},
               {"step": 3, "tokens": 600, "tokens_per_s": 150.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert bench.step_times(metrics, 0) == [10.0, 2.0, 2.0]
    assert bench.step_times(metrics, 1) == [2.0, 2.0]


def test_snapshot_is_what_imports(bench, tmp_path):
    """--code HEAD (the default) runs a commit's megalite, extracted: it must be the one imported."""
    sha, code = bench.snapshot("HEAD", tmp_path)
    assert sha == bench.git("rev-parse", "HEAD") and (code / "configs" / "demo.yaml").is_file()
    env = {**os.environ, "PYTHONPATH": str(code)}
    assert megalite_of(code, env).resolve().parent.parent == code.resolve()
    assert bench.snapshot("HEAD", tmp_path) == (sha, code)  # extracted once
    # A tree whose python imports another megalite (or none) is refused, naming what it found.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(SystemExit, match=f"{elsewhere}: its runs would import megalite from"):
        megalite_of(elsewhere, {**os.environ, "PYTHONPATH": str(code)})
