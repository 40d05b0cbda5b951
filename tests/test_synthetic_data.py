"""data.path=synthetic (Megatron's --mock-data): documents of random token ids, each ended by
eos, the same at every start and on every rank; padded mode counts what it truncates; and a
TP2 x DP2 run on them is the same training as one process."""
import numpy as np
import pytest

from megalite.prep.command import prepare_for_run
from megalite.run_config import DataConfig
from megalite.typed_config import ConfigError
from tests.support.data import tokenizer
from tests.support.runs import assert_same_training, common, run_train, train_run

DOCS = 300


def synthetic(cache: str, **settings) -> DataConfig:
    return DataConfig(**{"path": "synthetic", "cache_dir": cache, "bpe_vocab_size": 512,
                         "seq_len": 32, "synthetic_documents": DOCS, **settings})


def every_document(data) -> list[np.ndarray]:
    sets = [s.docs for s in data.train + data.val]
    return [doc for docs in sets for doc in docs.documents(np.arange(len(docs)), 10**9)]


@pytest.mark.unit
def test_the_documents_are_random_ids_ended_by_eos_and_the_same_at_every_start(cache):
    data, again = prepare_for_run(synthetic(cache)), prepare_for_run(synthetic(cache))
    (train,), (val,) = data.train, data.val
    assert len(train.docs) + len(val.docs) == DOCS and len(val.docs) == round(0.02 * DOCS)
    docs, docs_again = every_document(data), every_document(again)
    assert len(docs) == len(docs_again) == DOCS
    assert all(np.array_equal(a, b) for a, b in zip(docs, docs_again))
    eos, vocab = data.tokenizer.eos_id, data.tokenizer.vocab_size
    assert vocab == 512 and all(doc[-1] == eos for doc in docs)
    ids = np.concatenate([doc[:-1] for doc in docs])
    assert ids.max() < vocab and len(np.unique(ids)) > vocab * 0.9  # spread over the vocabulary
    lengths = np.array([len(doc) for doc in docs])
    # 2 to 2 x seq_len tokens: packed rows cross documents, padded rows pad or truncate.
    assert lengths.min() >= 2 and lengths.max() <= 64 and lengths.min() < 33 < lengths.max()
    assert data.meta["cache_key"] == again.meta["cache_key"]
    assert data.meta["cache_key"] != prepare_for_run(synthetic(cache, seq_len=64)).meta["cache_key"]


@pytest.mark.unit
def test_padded_mode_counts_the_documents_it_truncates(cache):
    data = prepare_for_run(synthetic(cache, mode="padded"))
    lengths = np.array([len(doc) for doc in every_document(data)])
    assert data.meta["truncated"] == int((lengths > 33).sum()) > 0


@pytest.mark.unit
def test_too_few_or_too_many_documents_are_refused_naming_the_setting(cache):
    with pytest.raises(ConfigError, match=r"data\.synthetic_documents=1 must be >= 2"):
        prepare_for_run(synthetic(cache, synthetic_documents=1))
    # Refused before anything is allocated: 10^9 documents of 33 tokens would be 66 GB per rank.
    with pytest.raises(ConfigError, match=r"data\.synthetic_documents=1000000000 at data\.seq_len=32 "
                                          r"is about 61\.5 GiB .*lower data\.synthetic_documents"):
        prepare_for_run(synthetic(cache, synthetic_documents=10**9))


@pytest.mark.unit
def test_blends_and_validation_take_synthetic_data_like_any_source(cache):
    blend = prepare_for_run(synthetic(cache, blend=[[0.5, "synthetic"], [0.5, "embedded"]]))
    assert [(s.name, s.weight) for s in blend.train] == [("synthetic", 0.5), ("embedded", 0.5)]
    assert len(blend.train[0].docs) == DOCS - round(0.02 * DOCS)
    held = prepare_for_run(synthetic(cache, path="embedded", val_path="synthetic"))
    assert [(s.name, len(s.docs)) for s in held.val] == [("synthetic", DOCS)]


@pytest.mark.exactness
def test_tp2_dp2_on_synthetic_data_trains_like_one_process(tmp_path, cache):
    single, layout = tmp_path / "single", tmp_path / "tp2dp2"
    data = ["data.path=synthetic", f"data.synthetic_documents={DOCS}"]
    train_run(1, common(cache, single, "packed") + data + ["parallel.tp=1", "train.micro_batch_size=8"])
    train_run(4, common(cache, layout, "packed") + data + ["parallel.tp=2", "train.micro_batch_size=2"])
    # Random ids: the loss stays near ln(512); what matters is that it agrees.
    assert_same_training(single, layout, learns=False)


@pytest.mark.unit
def test_a_given_tokenizer_sets_the_ids_and_eos(tmp_path, cache):
    data = prepare_for_run(synthetic(cache, tokenizer=str(tokenizer(tmp_path))))
    assert data.tokenizer.vocab_size == 400
    docs = every_document(data)
    assert all(doc[-1] == data.tokenizer.eos_id for doc in docs)
    assert max(int(doc.max()) for doc in docs) < 400


@pytest.mark.e2e
def test_a_global_batch_over_the_documents_names_the_setting(tmp_path, cache):
    with pytest.raises(ConfigError, match=r"train\.global_batch_size=8 exceeds the 3 training samples "
                                          r"of data path synthetic .*\(data\.synthetic_documents\)"):
        run_train(common(cache, tmp_path, "padded") + ["data.path=synthetic", "data.synthetic_documents=4"])
