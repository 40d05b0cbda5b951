"""Blends (data.blend): sources in proportion to their weights, any layout the same model, and
resume exact after a kill."""
import json
import subprocess
import time

import numpy as np
import pytest

from megalite.data.batches import BatchOrder, Mixture, Samples
from megalite.data.blend import assign
from megalite.prep.shards import PrepareSettings, prepare_directory
from megalite.prep.command import prepare_for_run
from megalite.data.raw_files import EMBEDDED
from megalite.run_config import DataConfig
from megalite.training.checkpoint_dirs import latest_checkpoint
from megalite.typed_config import ConfigError
from tests.support.launch import ROOT, kill_every_process_of, one_thread, run
from tests.support.resume import assert_continues_exactly, uninterrupted
from tests.support.runs import STEPS, assert_same_training, common, losses, train_run


@pytest.mark.unit
@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.25, 0.25], [0.05, 0.9, 0.05], [1.0]])
def test_every_prefix_of_the_stream_holds_each_source_in_proportion(weights):
    n = 20_000
    source, index = assign(np.arange(n), weights)
    for s, w in enumerate(weights):
        taken = np.cumsum(source == s)
        assert np.abs(taken - w * np.arange(1, n + 1)).max() <= 2, (s, w)
        # A source's samples are taken in order, each once: 0, 1, 2, ...
        assert np.array_equal(index[source == s], np.arange(taken[-1]))
    some = np.array([17, 4000, 19_999, 5])  # a pure function of the position
    assert [a.tolist() for a in assign(some, weights)] == [source[some].tolist(), index[some].tolist()]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two prepared directories of one tokenizer: the embedded corpus, and other prose."""
    root = tmp_path_factory.mktemp("blend")
    prepare_directory([EMBEDDED], root / "a", PrepareSettings(bpe_vocab_size=512, progress=False))
    (root / "b.jsonl").write_text("".join(
        json.dumps({"text": f"Note {i}: the pipeline sends activations forward and gradients "
                            f"back, {'stage by stage ' * (1 + i % 9)}"}) + "\n" for i in range(3000)))
    prepare_directory([root / "b.jsonl"], root / "b",
                      PrepareSettings(tokenizer=str(root / "a" / "tokenizer.json"), progress=False))
    return root / "a", root / "b"


def blend_args(sources) -> str:
    return f"data.blend=[[0.7, {sources[0]}], [0.3, {sources[1]}]]"


@pytest.mark.unit
def test_a_blend_consumes_tokens_in_proportion_over_200_steps(sources, tmp_path):
    data = prepare_for_run(DataConfig(blend=[[0.7, str(sources[0])], [0.3, str(sources[1])]],
                                   cache_dir=str(tmp_path / "cache")))
    mixture = Mixture([Samples(s.docs, "packed", 128, data.tokenizer.pad_id) for s in data.train],
                      [s.weight for s in data.train])
    order = BatchOrder(mixture.sizes, mixture.weights, 16, seed=1234)
    tokens = sum(mixture.collate(order.global_batch_picks(step)).target_count_per_source(2)
                 for step in range(200)).numpy()
    share = tokens / tokens.sum()
    assert abs(share[0] - 0.7) <= 0.02 * 0.7 and abs(share[1] - 0.3) <= 0.02 * 0.3, share


@pytest.mark.exactness
def test_a_blend_trains_the_same_model_at_tp2_dp2_and_reports_tokens_per_source(sources, tmp_path):
    base = common(str(tmp_path / "cache"), None, "packed")[:-1] + [blend_args(sources)]
    train_run(1, base + ["parallel.tp=1", "train.micro_batch_size=8", f"run.dir={tmp_path / 'one'}"])
    train_run(4, base + ["parallel.tp=2", "train.micro_batch_size=2", f"run.dir={tmp_path / 'tp2dp2'}"])
    assert_same_training(tmp_path / "one", tmp_path / "tp2dp2")
    per_source = [losses(tmp_path / d, "tokens_per_source")[STEPS] for d in ("one", "tp2dp2")]
    assert per_source[0] == per_source[1]
    assert sum(per_source[0].values()) == losses(tmp_path / "one", "tokens")[STEPS]
    assert list(per_source[0]) == [str(s) for s in sources]
    assert per_source[0][str(sources[0])] > per_source[0][str(sources[1])] > 0


@pytest.mark.e2e
def test_a_blend_resumes_exactly_after_a_kill(sources, tmp_path):
    def args(run_dir, *extra):
        return ["-m", "megalite.train"] + common(str(tmp_path / "cache"), run_dir, "packed") + [
            blend_args(sources), "model.dropout=0.1", "train.checkpoint_every=3",
            "train.micro_batch_size=8", "train.eval_every=2", *extra]

    import sys
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted(1, args(whole))
    proc = subprocess.Popen([sys.executable] + args(killed), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=one_thread())
    deadline = time.monotonic() + 240
    while latest_checkpoint(killed) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    kill_every_process_of(killed)
    proc.wait(timeout=60)
    resumed_from = int(latest_checkpoint(killed).name.split("_")[1])
    assert resumed_from < STEPS, "the run finished before it could be killed"
    run([sys.executable] + args(killed, "train.resume=auto"), env=one_thread())
    assert_continues_exactly(killed, whole, resumed_from)
    expected, got = losses(whole, "tokens_per_source"), losses(killed, "tokens_per_source")
    assert all(got[s] == expected[s] for s in expected if s > resumed_from)


@pytest.mark.unit
def test_blends_of_raw_files_with_their_own_bpe_are_refused(tmp_path):
    for name in ("x", "y"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"text": f"{name} text " * 50}) + "\n")
    with pytest.raises(ConfigError, match=r"the data was made with different tokenizers.*give "
                                          r"data\.tokenizer"):
        prepare_for_run(DataConfig(blend=[[1, str(tmp_path / "x.jsonl")], [1, str(tmp_path / "y.jsonl")]],
                                bpe_vocab_size=300, cache_dir=str(tmp_path / "cache")))
    with pytest.raises(ConfigError, match=r"data\.blend\[1\]=\[0, 'y'\]: each entry is \[weight, path\]"):
        prepare_for_run(DataConfig(blend=[[1, "x"], [0, "y"]], cache_dir=str(tmp_path / "cache")))


@pytest.mark.unit
@pytest.mark.parametrize("overrides, message", [
    ({"blend": [[1, "x"], [float("inf"), "y"]]}, r"data\.blend\[1\]=\[inf, 'y'\]: .*finite weight > 0"),
    ({"blend": [[1, "x"], [float("nan"), "y"]]}, r"data\.blend\[1\]=\[nan, 'y'\]"),
    ({"path": "x", "val_path": "./x"}, r"data\.val_path '\./x' is also training data"),
    ({"blend": [[1, "x"], [1, "y"]], "val_path": "y"}, r"data\.val_path 'y' is also training data"),
    ({"path": "x", "val_fraction": 1.0}, r"data\.val_fraction=1\.0 must be in \[0, 1\)"),
    ({"path": "x", "val_fraction": float("nan")}, r"data\.val_fraction=nan must be in \[0, 1\)"),
], ids=["inf-weight", "nan-weight", "val-is-train", "val-is-a-blend-source", "all-held-out", "nan-fraction"])
def test_weights_and_validation_data_that_cannot_work_are_refused(tmp_path, monkeypatch, overrides, message):
    monkeypatch.chdir(tmp_path)  # before any file is read: x and y need not exist
    with pytest.raises(ConfigError, match=message):
        prepare_for_run(DataConfig(cache_dir=str(tmp_path / "cache"), **overrides))
