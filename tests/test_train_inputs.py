"""Bad input to the trainer: a clear error before any collective, or handled and counted."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megalite.config import Experts, Latent, ModelConfig, Rotary
from megalite.data.batches import BatchOrder, Samples
from megalite.flat_keys import MOVED
from megalite.prep.command import prepare_for_run
from megalite.run_config import DataConfig
from megalite.train import main
from megalite.typed_config import ConfigError, from_dict, leaves
from tests.support.data import write_jsonl
from tests.support.runs import STEPS, assert_same_training, common, small_args, train_run

ROOT = Path(__file__).resolve().parent.parent


PROSE = ("Tensor parallelism splits each weight matrix across devices, so that every device "
         "holds a slice and computes part of each layer. ")


@pytest.mark.e2e
@pytest.mark.parametrize("extra,message", [
    (["data.path=/no/such/corpus.txt"], r"data path '/no/such/corpus\.txt' does not exist"),
    (["train.global_batch_size=3"], r"train\.global_batch_size=3 is not a multiple of train\.micro_batch_size=2 x DP=1"),
    (["train.global_batch_size=4096", "train.micro_batch_size=8"], r"train\.global_batch_size=4096 exceeds the \d+ training samples"),
    (["data.seq_len=4096"], r"data\.seq_len=4096 exceeds model\.max_seq_len=160"),
    (["parallel.tp=3"], r"^parallel\.tp=3 must divide the world size 1 and the model's heads \(4\), KV heads \(4\) and ffn_hidden \(128\): use parallel\.tp among \[1\] \(the divisors of the world size 1 that split the model\)$"),
    (["train.max_step=3"], r"unknown config key 'train\.max_step'; did you mean 'train\.max_steps'"),
])
def test_bad_config_is_one_clear_error(tmp_path, extra, message):
    corpus = write_jsonl(tmp_path / "c.jsonl", [PROSE * 3] * 40)
    with pytest.raises(ConfigError, match=message):
        main(small_args(tmp_path, corpus) + extra)


@pytest.mark.e2e
def test_a_tokenizer_vocabulary_tp_cannot_split_is_refused_before_any_collective(tmp_path, monkeypatch):
    """The layout passes with the config's vocabulary and fails with the tokenizer's, which is
    known once the data is prepared: still before the process group exists."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    corpus = write_jsonl(tmp_path / "c.jsonl", [PROSE * 3] * 40)
    with pytest.raises(ConfigError, match=r"parallel\.tp=2 must divide the model's padded vocab \(301\)"):
        main(small_args(tmp_path, corpus, "parallel.tp=2", "model.vocab_size=512",
                        "model.vocab_pad_multiple=1", "data.bpe_vocab_size=301"))
    assert not dist.is_initialized()


@pytest.mark.e2e
def test_signal_handlers_are_restored_after_a_run(tmp_path):
    import signal
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    corpus = write_jsonl(tmp_path / "c.jsonl", [PROSE * 3] * 40)
    assert main(small_args(tmp_path, corpus)) == 0
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before


@pytest.mark.e2e
def test_empty_corpus_is_an_error(tmp_path):
    corpus = write_jsonl(tmp_path / "empty.jsonl", ["", "   ", "\n"])
    with pytest.raises(ConfigError, match=r"hold no document to train a BPE on \(3 records, 3 empty, "
                                          r"0 without a text field 'text'\)"):
        main(small_args(tmp_path, corpus))


@pytest.mark.e2e
def test_malformed_jsonl_under_strict_names_the_line(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "fine"}\n{"txt": "wrong key"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: no string field 'text' \(its keys: txt\); "
                                          r"fix or drop it"):
        main(small_args(tmp_path, corpus, "data.strict=true"))


@pytest.mark.e2e
def test_empty_long_and_undecodable_documents_are_handled_and_counted(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"{i}.txt").write_text(PROSE * (1 + 20 * (i % 2)))  # odd ones: far past seq_len
    (docs / "empty.txt").write_text("  \n")
    (docs / "latin1.txt").write_bytes(("caf\xe9 " + PROSE).encode("latin-1"))
    assert main(small_args(tmp_path, docs)) == 0
    out = capsys.readouterr().out
    assert "1 empty documents skipped" in out
    assert "1 documents had bytes that are not UTF-8" in out
    assert "3 documents longer than data.seq_len were truncated" in out


@pytest.mark.e2e
@pytest.mark.parametrize("extra,message", [
    (["train.resume=never"], r"run\.dir '.*' already holds checkpoints \(latest step_00000002\): train\.resume=never would overwrite them"),
    (["train.global_batch_size=4", "train.max_steps=4"], r"cannot resume from '.*step_00000002': train\.global_batch_size: 2 -> 4\. Resume with the saved values, or a new run\.dir \(run\.dir '.*run' holds this checkpoint\)"),
    (["train.resume={run}/checkpoints/step_00000002", "run.seed=7", "train.max_steps=4"], r"run\.seed: 1234 -> 7\. Resume with the saved values, or train\.init_from=.*step_00000002 to start a new run from its weights"),
    (["run.seed=7", "train.max_steps=4"], r"cannot resume from .*: run\.seed: 1234 -> 7"),
    (["data.bpe_vocab_size=400", "train.max_steps=4"], r"cannot resume from .*: data\.bpe_vocab_size: 512 -> 400\. Resume"),
    (["train.resume=/nowhere/step_00000001"], r"train\.resume: '/nowhere/step_00000001' does not exist; or train\.resume=auto for run\.dir's latest"),
])
def test_a_refused_launch_loses_nothing_already_saved(tmp_path, extra, message):
    corpus = write_jsonl(tmp_path / "c.jsonl", [PROSE * 3] * 40)
    assert main(small_args(tmp_path, corpus)) == 0
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=message):
        main(small_args(tmp_path, corpus, *(e.format(run=tmp_path / "run") for e in extra)))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == saved
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


@pytest.mark.e2e
def test_a_resume_compares_the_datas_content_not_its_files_times(tmp_path):
    """A copy of the corpus (new times: a clone, another node's disk) resumes; other text under
    the same path is refused (before, the files' times were the data's identity)."""
    corpus = write_jsonl(tmp_path / "c.jsonl", [PROSE * 3] * 40)
    assert main(small_args(tmp_path, corpus)) == 0
    os.utime(corpus, ns=(1, 1))  # as a copy has: other times, the same bytes
    assert main(small_args(tmp_path, corpus, "train.max_steps=3")) == 0
    write_jsonl(corpus, [PROSE * 2] * 40)
    with pytest.raises(ConfigError, match=r"cannot resume from .*step_00000003': the tokenized "
                                          r"data \(corpus or tokenizer\) differs"):
        main(small_args(tmp_path, corpus, "train.max_steps=4"))


def flat_model(model: dict) -> dict:
    """A model of meta.json as megalite wrote it before the config had sections: every key of
    flat_keys.MOVED at the top (those of variants the model does not use at their defaults)."""
    cfg = from_dict(ModelConfig, model, "model.")
    every = ModelConfig(attention=Latent(), positions=Rotary(), mlp=Experts())  # the others' keys
    values = {key: value for c in (every, cfg) for key, value, _ in leaves(c)}
    flat = {key: value for key, value in model.items() if not isinstance(value, dict)}
    flat.update({old: values[new] for old, new in MOVED.items() if new in values})
    return json.loads(json.dumps({**flat, "n_experts": cfg.n_experts}))


@pytest.mark.e2e
def test_a_checkpoint_and_config_of_the_previous_version_resume(tmp_path, capsys):
    """Written before the model config had sections (flat keys), before rope scaling,
    decay_steps and eval_tokens existed (with eval_batches) and before the keyed sample order:
    the flat keys are read as the sections they mean (the config's with a note), the missing
    keys mean their defaults, the retired one is dropped with a note, the schedule is the one
    the run started with (decay to min_lr at its max_steps), and the resume says the sample
    order changed (only then)."""
    import yaml
    corpus = write_jsonl(tmp_path / "c.jsonl", [PROSE * 3] * 40)
    assert main(small_args(tmp_path, corpus, "train.max_steps=4")) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["config"]["model"] = flat_model(meta["config"]["model"])
    for section, keys in (("model", [k for k in meta["config"]["model"] if k.startswith("rope_")
                                     and k != "rope_theta"]), ("train", ["decay_steps", "eval_tokens"])):
        for key in keys:
            del meta["config"][section][key]
    meta["config"]["train"]["eval_batches"] = 4
    assert meta.pop("sample_order") == 2
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    old_config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    old_config["model"], old_config["train"] = meta["config"]["model"], meta["config"]["train"]
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old_config))
    with pytest.warns(UserWarning, match="train.eval_batches is retired") as notes:
        assert main(["--config", str(tmp_path / "old.yaml"), "train.max_steps=6"]) == 0
    assert any("model keys of before the config had sections, translated" in str(n.message) for n in notes)
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
           if "lr" in r}
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6] and lrs[5] == lrs[6] == 1e-4  # common()'s min_lr
    assert capsys.readouterr().out.count("  sample order: the checkpoint's megalite") == 1
    assert main(["--config", str(tmp_path / "old.yaml"), "train.max_steps=7"]) == 0
    assert "sample order" not in capsys.readouterr().out  # step 6 was saved by this version


@pytest.mark.unit
def test_one_bad_byte_marks_only_its_own_document(tmp_path):
    from megalite.prep.sources import parse, read_chunks
    path = tmp_path / "three.txt"
    path.write_bytes(b"first document\n\n\ncaf\xe9 second\n\n\nthird document")
    texts, counts = [], []
    for chunk in read_chunks(path, "text"):
        got, c = parse(chunk, "text", False, str(path))
        texts += got
        counts.append(c.invalid_utf8)
    assert texts == ["first document", "caf\ufffd second", "third document"] and sum(counts) == 1


@pytest.mark.e2e
def test_every_rank_exits_with_the_error_under_torchrun(tmp_path):
    start = time.monotonic()
    done = subprocess.run(
        # Polled every 2 s (not 0.1 s), torchrun lets the second rank print its error before it
        # stops the group for the first rank's exit.
        [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "2",
         "--nproc_per_node", "2", "-m", "megalite.train", *small_args(tmp_path, "/no/such/corpus.txt", "train.global_batch_size=4")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert (done.stdout + done.stderr).count("data path '/no/such/corpus.txt' does not exist") >= 2
    assert time.monotonic() - start < 90


@pytest.mark.exactness
def test_dp_ranks_with_very_different_pad_counts_train_like_one_process(tmp_path):
    """One-sentence and thirty-sentence documents: in padded mode the DP ranks of a step hold
    very different numbers of real tokens; the global-token loss makes that irrelevant."""
    corpus = write_jsonl(tmp_path / "mixed.jsonl",
                         ["A short note." if i % 3 else PROSE * 30 for i in range(48)])
    args = common(str(tmp_path / "cache"), None, "padded")[:-1] + [
        f"data.path={corpus}", "data.val_fraction=0.0", "data.seq_len=96", "model.max_seq_len=96",
        "train.global_batch_size=4", "train.micro_batch_size=1"]
    data = prepare_for_run(DataConfig(path=str(corpus), bpe_vocab_size=512, seq_len=96,
                                   val_fraction=0.0, cache_dir=str(tmp_path / "cache")))
    samples = Samples(data.train[0].docs, "padded", 96, data.tokenizer.pad_id)
    order = BatchOrder([len(samples)], [1.0], 4, seed=1234)
    real = [[sum(int(samples.collate(m[:, 1]).target_count()) for m in order.micro_batches(s, r, 2, 1))
             for r in range(2)] for s in range(STEPS)]
    assert max(max(r) / max(1, min(r)) for r in real) > 5, real

    train_run(1, args + [f"run.dir={tmp_path / 'one'}"])
    train_run(2, args + [f"run.dir={tmp_path / 'dp2'}"])
    assert_same_training(tmp_path / "one", tmp_path / "dp2")


@pytest.mark.unit
@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_run_configs_load_and_fit_their_layout(config):
    from megalite.run_config import load_config
    from megalite.plan import validate
    cfg = load_config(ROOT / "configs" / config)
    dp = cfg.train.global_batch_size // cfg.train.micro_batch_size
    validate(cfg, cfg.parallel.tp * min(dp, 2))


@pytest.mark.e2e
def test_wandb_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    corpus = write_jsonl(tmp_path / "c.jsonl", [PROSE * 3] * 40)
    with pytest.raises(ConfigError, match=r"run\.wandb=true needs the wandb package: pip install 'megalite\[wandb\]'"):
        main(small_args(tmp_path, corpus, "run.wandb=true"))


@pytest.mark.unit
def test_a_row_of_no_tokens_is_refused_before_any_data_is_read():
    from megalite.run_config import load_config
    from megalite.plan import validate
    with pytest.raises(ConfigError, match=r"data\.seq_len=0 must be >= 1"):
        validate(load_config(ROOT / "configs" / "demo.yaml", ["data.seq_len=0", "parallel.tp=1"]), 1)
