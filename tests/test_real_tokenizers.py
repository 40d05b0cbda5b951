"""Standard tokenizers as they are: GPT-2's, Llama 2's and Llama 3's shapes, built here with the
`tokenizers` library and saved as Hugging Face tokenizer directories (nothing is downloaded),
and how megalite reads, stores and exports them. Training on them: test_real_tokenizers_train.py.

None has a pad token; their end-of-document tokens are `<|endoftext|>`, `</s>` and
`<|end_of_text|>`; Llama's post-processors put bos first, GPT-2's adds nothing.
"""
import hashlib
import json
from itertools import product

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from megalite.prep import command as prepare
from megalite.data.batches import collate
from megalite.data.tokenizer import load_tokenizer, save_tokenizer, train_bpe
from megalite.hf.convert import special_ids
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.run_config import DataConfig
from megalite.typed_config import ConfigError
from tests.support.models import CONFIGS
from tests.support.tokenizer_shapes import SHAPES, TEXTS, hf_directory

pytestmark = pytest.mark.unit


# (eos, bos) by name; the template puts bos first for the Llamas only.
EXPECTED = {"gpt2": ("<|endoftext|>", "<|endoftext|>"), "llama2": ("</s>", "<s>"),
            "llama3": ("<|end_of_text|>", "<|begin_of_text|>")}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_shape_loads_with_its_own_specials_and_template(hf_tokenizers, name):
    info = load_tokenizer(hf_tokenizers[name])
    token = info.tokenizer.token_to_id
    eos, bos = EXPECTED[name]
    assert (info.eos_id, info.bos_id) == (token(eos), token(bos))
    assert info.pad_id == info.eos_id  # no pad token: eos fills padded positions
    if name == "gpt2":
        assert info.vocab_size == 50_257 and info.eos_id == 50_256
    text = TEXTS[3]
    bare = info.tokenizer.encode(text, add_special_tokens=False).ids
    assert info.encode(text) == ([] if name == "gpt2" else [info.bos_id]) + bare
    assert info.encode_documents([text, TEXTS[4]])[0] == info.encode(text) + [info.eos_id]
    # Its tokenizer.json, named so, is read with the files beside it.
    assert load_tokenizer(hf_tokenizers[name] / "tokenizer.json").names == info.names


def test_a_template_that_ends_with_eos_gets_no_second_one(tmp_path):
    tok = train_bpe(TEXTS[:50], 300)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>", special_tokens=[("<|bos|>", 1), ("<|eos|>", 0)])
    tok.save(str(tmp_path / "t.json"))
    info = load_tokenizer(tmp_path / "t.json")
    (doc,) = info.encode_documents([TEXTS[0]])
    assert doc[0] == 1 and doc[-1] == 0 and doc[-2] != 0 and doc == info.encode(TEXTS[0])


def test_a_template_that_puts_eos_first_only_still_ends_each_document_with_it(tmp_path):
    """OPT's shape: bos is eos (`</s>`), the template puts it before a text and not after."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS[:50], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
    names = {"bos_token": "</s>", "eos_token": "</s>", "pad_token": "<pad>"}
    info = load_tokenizer(hf_directory(tmp_path, tok, names, names))
    bare = tok.encode("hello world", add_special_tokens=False).ids
    assert info.encode_documents(["hello world"]) == [[2] + bare + [2]]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_stored_tokenizer_keeps_its_specials(hf_tokenizers, tmp_path, name):
    info = load_tokenizer(hf_tokenizers[name])
    save_tokenizer(info, tmp_path)
    stored = load_tokenizer(tmp_path)
    assert (stored.names, stored.digest) == (info.names, info.digest)
    assert (stored.eos_id, stored.bos_id, stored.pad_id) == (info.eos_id, info.bos_id, info.pad_id)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EXPECTED[name][0] and "pad_token" not in info.names
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)  # reads it as megalite does
    assert (theirs.eos_token, theirs.bos_token) == EXPECTED[name]
    assert theirs(TEXTS[3]).input_ids == info.encode(TEXTS[3])


def test_megalites_own_bpe_alone_loads_as_before(tmp_path):
    """Older checkpoints and prepared directories hold only megalite's tokenizer.json: the same
    ids, and the same key (its file's hash) for their data; a Llama tokenizer's key changes,
    since its documents now start with bos."""
    path = tmp_path / "tokenizer.json"
    train_bpe(TEXTS[:50], 300).save(str(path))
    info = load_tokenizer(path)
    assert (info.eos_id, info.bos_id, info.pad_id) == (0, 1, 2)
    assert info.encode(TEXTS[0]) == info.tokenizer.encode(TEXTS[0], add_special_tokens=False).ids
    assert info.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not (tmp_path / "tokenizer_config.json").exists()


def test_llama_key_differs_from_its_files_hash(hf_tokenizers):
    llama = hf_tokenizers["llama2"]
    assert load_tokenizer(llama).digest != hashlib.sha256((llama / "tokenizer.json").read_bytes()).hexdigest()
    gpt2 = hf_tokenizers["gpt2"]
    assert load_tokenizer(gpt2).digest == hashlib.sha256((gpt2 / "tokenizer.json").read_bytes()).hexdigest()


def test_a_tokenizer_json_alone_picks_eos_as_earlier_versions_did(tmp_path, hf_tokenizers):
    """Older prepared directories, caches and checkpoints hold a tokenizer.json and nothing
    naming its eos: of several known names it takes the one earlier versions took (<|eos|>,
    then </s>, <|endoftext|>, <eos>), with its file's hash as its key; a directory whose
    files name none is refused instead, naming the key."""
    several = train_bpe(TEXTS[:50], 300)
    several.add_special_tokens(["<|endoftext|>", "</s>"])  # and megalite's <|eos|>
    several.save(str(tmp_path / "tokenizer.json"))
    info = load_tokenizer(tmp_path)
    assert info.names["eos_token"] == "<|eos|>" and info.eos_id == 0
    assert info.digest == hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
    assert load_tokenizer(tmp_path, "</s>").digest != info.digest  # other documents: another key

    chat = Tokenizer.from_file(str(hf_tokenizers["llama3"] / "tokenizer.json"))
    chat.add_special_tokens(["<|endoftext|>"])  # <|end_of_text|> is a name added since
    chat.save(str(tmp_path / "chat.json"))
    assert load_tokenizer(tmp_path / "chat.json").names["eos_token"] == "<|endoftext|>"

    named_nothing = hf_directory(tmp_path / "hf", several, {"model_max_length": 1024}, {})
    with pytest.raises(ConfigError, match=r"several end-of-document tokens \(<\|eos\|>, </s>, "
                                          r"<\|endoftext\|>\).*data\.eos_token=NAME \(--eos-token NAME"):
        load_tokenizer(named_nothing)
    assert load_tokenizer(named_nothing, "</s>").eos_id == several.token_to_id("</s>")


def test_a_missing_or_unknown_eos_is_named_with_a_key(tmp_path, hf_tokenizers):
    none = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    none.save(str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match=r"no end-of-document token megalite knows \(<\|eos\|>, "
                                          r"</s>, <\|endoftext\|>, <eos>, <\|end_of_text\|>\): name "
                                          r"the one .* data\.eos_token=NAME"):
        load_tokenizer(tmp_path / "none.json")
    with pytest.raises(ConfigError, match=r"the eos token given '<\|eot\|>' is not in its vocabulary"):
        load_tokenizer(hf_tokenizers["llama3"], "<|eot|>")
    assert load_tokenizer(hf_tokenizers["llama3"], "<|eot_id|>").names["eos_token"] == "<|eot_id|>"


def test_a_tokenizer_saved_truncating_or_padding_keeps_whole_documents(tmp_path):
    tok = train_bpe(TEXTS[:50], 300)
    tok.save(str(tmp_path / "plain.json"))
    tok.enable_truncation(max_length=4)
    tok.enable_padding(length=300, pad_id=2, pad_token="<|pad|>")
    tok.save(str(tmp_path / "cut.json"))
    plain, cut = load_tokenizer(tmp_path / "plain.json"), load_tokenizer(tmp_path / "cut.json")
    texts = [TEXTS[0], TEXTS[1][:20]]
    assert cut.encode_documents(texts) == plain.encode_documents(texts)
    assert len(cut.encode(TEXTS[0])) > 4 and cut.encode(TEXTS[0]) == plain.encode(TEXTS[0])
    assert cut.digest == hashlib.sha256((tmp_path / "cut.json").read_bytes()).hexdigest()


def test_export_names_bos_where_the_tokenizer_has_none(tmp_path, hf_tokenizers):
    """A GPT-2 directory as the Hub has it (its tokenizer_config.json sets model_max_length
    only) declares no bos; its config.json says 50256 for bos and eos, and so does export's."""
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "tokenizer.json").write_bytes((hf_tokenizers["gpt2"] / "tokenizer.json").read_bytes())
    (gpt2 / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    assert load_tokenizer(gpt2).bos_id is None
    assert special_ids(load_tokenizer(gpt2)) == \
        {"eos_token_id": 50_256, "bos_token_id": 50_256, "pad_token_id": None}
    assert special_ids(load_tokenizer(hf_tokenizers["llama2"])) == \
        {"eos_token_id": 2, "bos_token_id": 1, "pad_token_id": None}


def test_the_eos_named_for_prepare_data_is_the_stored_one(tmp_path, corpus):
    both = train_bpe(TEXTS[:50], 300)
    both.add_special_tokens(["<|endoftext|>"])  # and megalite's <|eos|>: two known names
    directory = hf_directory(tmp_path / "both", both, {"model_max_length": 1024}, {})
    argv = ["--input", str(corpus), "--tokenizer", str(directory), "--workers", "0"]
    with pytest.raises(ConfigError, match=r"several end-of-document tokens .*\(--eos-token NAME"):
        prepare.main(argv + ["--out", str(tmp_path / "refused")])
    prepare.main(argv + ["--out", str(tmp_path / "out"), "--eos-token", "<|endoftext|>"])
    stored = load_tokenizer(tmp_path / "out")
    eos = both.token_to_id("<|endoftext|>")
    assert stored.eos_id == eos and stored.pad_id == 2  # its <|pad|> fills
    data = prepare.prepare_for_run(DataConfig(path=str(tmp_path / "out"), val_fraction=0.0))
    docs = data.train[0].docs
    assert data.tokenizer.eos_id == eos and all(d[-1] == eos for d in docs.documents(np.arange(5), 10**6))
    # Without a tokenizer the eos token names nothing: one rule, for a run and prepare-data.
    refused = r"eos token '</s>' \(data\.eos_token, --eos-token\) names .* give the tokenizer"
    with pytest.raises(ConfigError, match=refused):
        prepare.prepare_for_run(DataConfig(path=str(tmp_path / "out"), eos_token="</s>"))
    with pytest.raises(ConfigError, match=refused):
        prepare.main(["--input", str(corpus), "--out", str(tmp_path / "bpe"), "--eos-token", "</s>"])


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_padded_batches_train_the_same_whatever_fills_the_padding(arch):
    """A pad token is not needed, so any id may fill padded positions: right-padded, as collate
    makes training rows, causal attention hides them from every real token (no mask is given,
    as in training) and their labels are -100; left-padded, as prompts are, the attention mask
    hides them. The fill id changes neither the loss nor any gradient, and either side gives
    the real tokens the same losses."""
    cfg = CONFIGS[arch]
    rows = [torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).numpy()
            for n in (17, 5, 11, 2)]
    results = {"right": [], "left": []}
    for side, fill in product(results, (0, 7, cfg.vocab_size - 1)):
        model = GPT(cfg, ParallelState(), seed=3)
        batch = collate("padded", rows, fill)
        ids, mask, labels = batch.input_ids, batch.attention_mask, batch.labels
        assert bool((ids[mask == 0] == fill).all())
        pads = (mask == 0).sum(dim=1).tolist()
        if side == "left":
            ids, mask, labels = (torch.stack([r.roll(n) for r, n in zip(x, pads)])
                                 for x in (ids, mask, labels))
        losses = model(ids, attention_mask=mask if side == "left" else None, labels=labels).token_losses
        losses.sum().backward()
        if side == "left":  # back in the right-padded places
            losses = torch.stack([r.roll(-n) for r, n in zip(losses.detach(), pads)])
        results[side].append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
    for same in results.values():
        for losses, grads in same[1:]:
            assert torch.equal(losses, same[0][0])
            assert all(torch.equal(grads[n], same[0][1][n]) for n in grads)
    torch.testing.assert_close(results["left"][0][0], results["right"][0][0], atol=1e-5, rtol=1e-5)
