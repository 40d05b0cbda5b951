"""Data preparation: the cache, user tokenizers, and the batches each DP rank reads."""
import json
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from megalite.prep import command as prepare
from megalite.data.batches import BatchOrder, Samples
from megalite.prep.command import prepare_for_run
from megalite.run_config import DataConfig
from tests.support.data import write_jsonl

TEXTS = [f"Document number {i} talks about tensors and gradients. " * (1 + i % 4) for i in range(30)]


def corpus(tmp_path):
    return write_jsonl(tmp_path / "c.jsonl", TEXTS)


def user_tokenizer(tmp_path, special):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                       show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.unit
def test_user_tokenizer_is_used_with_its_special_tokens(tmp_path):
    tok = user_tokenizer(tmp_path, ["<s>", "</s>", "<pad>"])
    data = prepare_for_run(DataConfig(path=str(corpus(tmp_path)), tokenizer=str(tok),
                                   cache_dir=str(tmp_path / "cache")))
    assert (data.tokenizer.bos_id, data.tokenizer.eos_id, data.tokenizer.pad_id) == (0, 1, 2)
    assert data.tokenizer.vocab_size == Tokenizer.from_file(str(tok)).get_vocab_size()
    docs = data.train[0].docs
    assert all(d[-1] == 1 for d in docs.documents(np.arange(len(docs)), 10**6))  # each ends with eos


@pytest.mark.unit
def test_user_tokenizer_without_padding_token_pads_with_eos(tmp_path):
    tok = user_tokenizer(tmp_path, ["</s>"])
    data = prepare_for_run(DataConfig(path=str(corpus(tmp_path)), tokenizer=str(tok),
                                   cache_dir=str(tmp_path / "cache")))
    assert data.tokenizer.pad_id == data.tokenizer.eos_id == 0


@pytest.mark.unit
def test_cache_is_built_once_and_rebuilt_when_the_corpus_changes(tmp_path):
    cfg = DataConfig(path=str(corpus(tmp_path)), bpe_vocab_size=300, cache_dir=str(tmp_path / "cache"))
    first = prepare_for_run(cfg)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the entry (its lock: node-local, prep/locks.py)
    again = prepare_for_run(cfg)
    assert np.array_equal(first.train[0].docs.window([0], first.train[0].docs.n_tokens)[0],
                          again.train[0].docs.window([0], again.train[0].docs.n_tokens)[0])
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "something else entirely"}) * 1 + "\n"
                                      + json.dumps({"text": "and more"}) + "\n")
    prepare_for_run(cfg)
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 2


@pytest.mark.unit
@pytest.mark.parametrize("given", [True, False])  # a tokenizer given, or a BPE trained here
def test_a_rerun_with_nothing_to_do_keeps_an_older_directorys_data_key(tmp_path, given):
    """A directory an earlier version prepared has no bos_id or pad_id in meta.json and no file
    naming its tokenizer's specials. Its data key, which checkpoints record, is meta.json's
    hash: a re-run that finds every shard done leaves it byte for byte."""
    out = tmp_path / "prep"
    argv = ["--input", str(corpus(tmp_path)), "--out", str(out), "--workers", "0",
            "--bpe-vocab-size", "300"]
    if given:  # two known eos names, of which earlier versions took <|eos|>
        argv += ["--tokenizer", str(user_tokenizer(tmp_path, ["<|eos|>", "</s>", "<pad>"]))]
    assert prepare.main(argv) == 0
    meta = json.loads((out / "meta.json").read_text())
    for key in ("bos_id", "pad_id"):
        del meta["tokenizer"][key]
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (out / name).unlink()
    older = (out / "meta.json").read_bytes()
    key = prepare_for_run(DataConfig(path=str(out))).meta["cache_key"]
    assert prepare.main(argv) == 0
    assert (out / "meta.json").read_bytes() == older
    assert prepare_for_run(DataConfig(path=str(out))).meta["cache_key"] == key


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_dp_ranks_read_disjoint_rows_of_a_layout_independent_global_batch(tmp_path, mode):
    data = prepare_for_run(DataConfig(path=str(corpus(tmp_path)), bpe_vocab_size=300,
                                   cache_dir=str(tmp_path / "cache"), val_fraction=0.0))
    samples = Samples(data.train[0].docs, mode, 16, data.tokenizer.pad_id)
    order = BatchOrder([len(samples)], [1.0], 8, seed=3)
    for step in (0, 5, 40):  # 40 is several epochs in
        everyone = sorted(np.concatenate(order.micro_batches(step, 0, 1, 8))[:, 1].tolist())
        split = [np.concatenate(order.micro_batches(step, r, 4, 1))[:, 1].tolist() for r in range(4)]
        assert sorted(sum(split, [])) == everyone
        assert not set(split[0]) & set(split[1])
    batch = samples.collate(order.micro_batches(0, 0, 1, 8)[0][:, 1])
    if mode == "padded":
        assert bool((batch.input_ids[batch.attention_mask == 0] == data.tokenizer.pad_id).all())


@pytest.mark.e2e
def test_prepare_data_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megalite", "prepare-data",
                           f"data.path={corpus(tmp_path)}", "data.bpe_vocab_size=300",
                           f"data.cache_dir={tmp_path / 'cache'}"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["train_documents"] + json.loads(done.stdout)["val_documents"] == 30
