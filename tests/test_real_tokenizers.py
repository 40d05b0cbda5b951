"""Standard tokenizers as they are: GPT-2's, Llama 2's and Llama 3's shapes, built here with the
`tokenizers` library and saved as Hugging Face tokenizer directories (nothing is downloaded).

None has a pad token; their end-of-document tokens are `<|endoftext|>`, `</s>` and
`<|end_of_text|>`; Llama's post-processors put bos first, GPT-2's adds nothing.
"""
import hashlib
import json
import math
import shutil
from itertools import islice, product

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from megalite import evaluate
from megalite.data import prepare
from megalite.data.batches import collate
from megalite.data.sources import EMBEDDED, documents
from megalite.data.tokenizer import load_tokenizer, save_tokenizer, train_bpe
from megalite.hf import convert
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.run_config import DataConfig
from megalite.typed_config import ConfigError
from tests.harness import run_distributed
from tests.models import CONFIGS
from tests.test_train import run_train

TEXTS = list(islice(documents(EMBEDDED), 400))


def added(content: str) -> dict:
    """A special token as transformers writes it into tokenizer_config.json."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}


def hf_directory(directory, tokenizer: Tokenizer, config: dict, special_map: dict):
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
    return directory


def gpt2_shaped(directory):
    """Byte-level BPE of exactly 50,257 ids: 256 bytes, 50,000 merges, `<|endoftext|>` last."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = list(islice(product(alphabet, alphabet), 50_000))
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update((a + b, len(alphabet) + i) for i, (a, b) in enumerate(merges))
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return hf_directory(directory, tok, {"model_max_length": 1024},
                        {name: "<|endoftext|>" for name in ("bos_token", "eos_token", "unk_token")})


def llama2_shaped(directory):
    """`<unk>`, `<s>`, `</s>` first; its template puts `<s>` before a text; no pad."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    names = {"bos_token": added("<s>"), "eos_token": added("</s>"), "unk_token": added("<unk>")}
    return hf_directory(directory, tok, {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                                         "add_eos_token": False, "pad_token": None, **names}, names)


LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|reserved_special_token_2|>", "<|eot_id|>",
                  *(f"<|reserved_special_token_{i}|>" for i in range(3, 8))]


def llama3_shaped(directory):
    """Byte-level BPE, its special tokens after the vocabulary, `<|begin_of_text|>` put first
    by the template, `<|end_of_text|>` ending a document, reserved tokens, no pad."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(LLAMA3_SPECIAL)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return hf_directory(directory, tok, {"tokenizer_class": "PreTrainedTokenizerFast",
                                         "bos_token": "<|begin_of_text|>",
                                         "eos_token": "<|end_of_text|>", "model_max_length": 131072},
                        {"bos_token": added("<|begin_of_text|>"), "eos_token": added("<|end_of_text|>")})


SHAPES = {"gpt2": gpt2_shaped, "llama2": llama2_shaped, "llama3": llama3_shaped}
# (eos, bos) by name; the template puts bos first for the Llamas only.
EXPECTED = {"gpt2": ("<|endoftext|>", "<|endoftext|>"), "llama2": ("</s>", "<s>"),
            "llama3": ("<|end_of_text|>", "<|begin_of_text|>")}


@pytest.fixture(scope="module")
def hf_tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: build(root / name) for name, build in SHAPES.items()}


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


def test_an_ambiguous_or_missing_eos_is_named_with_a_key(tmp_path, hf_tokenizers):
    both = train_bpe(TEXTS[:50], 300)
    both.add_special_tokens(["<|endoftext|>", "</s>"])
    both.save(str(tmp_path / "both.json"))
    with pytest.raises(ConfigError, match=r"several end-of-document tokens \(<\|endoftext\|>, </s>, "
                                          r"<\|eos\|>\).*data\.eos_token=NAME \(--eos-token NAME"):
        load_tokenizer(tmp_path / "both.json")
    assert load_tokenizer(tmp_path / "both.json", "</s>").eos_id == both.token_to_id("</s>")

    # Llama 3's tokenizer.json alone, under another name: its <|end_of_text|> is found by name.
    alone = tmp_path / "llama3.json"
    alone.write_bytes((hf_tokenizers["llama3"] / "tokenizer.json").read_bytes())
    assert load_tokenizer(alone).names["eos_token"] == "<|end_of_text|>"
    chat = Tokenizer.from_file(str(alone))
    chat.add_special_tokens(["<|endoftext|>"])
    chat.save(str(alone))
    with pytest.raises(ConfigError, match="several end-of-document tokens"):
        load_tokenizer(alone)
    assert load_tokenizer(alone, "<|eot_id|>").eos_id == chat.token_to_id("<|eot_id|>")

    none = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    none.save(str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match=r"no end-of-document token megalite knows \(<\|endoftext"
                                          r"\|>, </s>, <\|end_of_text\|>, <\|eos\|>, <eos>\): name "
                                          r"the one .* data\.eos_token=NAME"):
        load_tokenizer(tmp_path / "none.json")
    with pytest.raises(ConfigError, match=r"the eos token given '<\|eot\|>' is not in its vocabulary"):
        load_tokenizer(hf_tokenizers["llama3"], "<|eot|>")


def test_the_eos_named_for_prepare_data_is_the_stored_one(tmp_path, corpus):
    both = train_bpe(TEXTS[:50], 300)
    both.add_special_tokens(["<|endoftext|>"])  # and megalite's <|eos|>: two known names
    both.save(str(tmp_path / "both.json"))
    argv = ["--input", str(corpus), "--tokenizer", str(tmp_path / "both.json"), "--workers", "0"]
    with pytest.raises(ConfigError, match=r"several end-of-document tokens .*\(--eos-token NAME"):
        prepare.main(argv + ["--out", str(tmp_path / "refused")])
    prepare.main(argv + ["--out", str(tmp_path / "out"), "--eos-token", "<|endoftext|>"])
    stored = load_tokenizer(tmp_path / "out")
    eos = both.token_to_id("<|endoftext|>")
    assert stored.eos_id == eos and stored.pad_id == 2  # its <|pad|> fills
    data = prepare.prepare_data(DataConfig(path=str(tmp_path / "out"), val_fraction=0.0))
    docs = data.train[0].docs
    assert data.tokenizer.eos_id == eos and all(d[-1] == eos for d in docs.documents(np.arange(5), 10**6))
    with pytest.raises(ConfigError, match=r"data\.eos_token='</s>' names the end of document of "
                                          r"data\.tokenizer, which is bpe"):
        prepare.prepare_data(DataConfig(path=str(tmp_path / "out"), eos_token="</s>"))
    with pytest.raises(ConfigError, match=r"--eos-token </s> names .*: give --tokenizer too"):
        prepare.main(["--input", str(corpus), "--out", str(tmp_path / "bpe"), "--eos-token", "</s>"])


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_padded_batches_train_the_same_whatever_fills_the_padding(arch):
    """A pad token is not needed: padded positions are masked out of attention and loss, so
    the fill id changes neither the loss nor any gradient."""
    cfg = CONFIGS[arch]
    rows = [torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).numpy()
            for n in (17, 5, 11, 2)]
    results = []
    for fill in (0, 7, cfg.vocab_size - 1):
        model = GPT(cfg, ParallelState(), seed=3)
        batch = collate("padded", rows, fill)
        assert bool((batch.input_ids[batch.attention_mask == 0] == fill).all())
        losses = model(batch.input_ids, attention_mask=batch.attention_mask,
                       labels=batch.labels).token_losses
        losses.sum().backward()
        results.append((losses.detach(), {n: p.grad for n, p in model.named_parameters()}))
    for losses, grads in results[1:]:
        assert torch.equal(losses, results[0][0])
        assert all(torch.equal(grads[n], results[0][1][n]) for n in grads)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:40]))
    return path


def eval_text(tmp_path, tokenizer) -> tuple[object, list[int]]:
    """A file of documents not trained on, and its ids as `tokenizer` encodes it."""
    text = tmp_path / "eval.txt"
    text.write_text("\n\n".join(TEXTS[300:302]))
    return text, load_tokenizer(tokenizer).encode(text.read_text())


def megalite_eval(ckpt, text, capsys) -> dict:
    capsys.readouterr()
    assert evaluate.main(["--ckpt", str(ckpt), "--text", str(text), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gpt2_hf(hf_tokenizers, tmp_path_factory):
    """A random transformers GPT-2 with GPT-2's vocabulary (50,257 rows), in a Hugging Face
    directory with the GPT-2-shaped tokenizer."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("gpt2-hf")
    for f in hf_tokenizers["gpt2"].iterdir():
        shutil.copyfile(f, directory / f.name)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50_257, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=4, activation_function="gelu_new")
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(directory)
    return directory, model


def test_gpt2s_vocabulary_imports_and_evaluates_as_transformers(gpt2_hf, tmp_path, capsys):
    import transformers
    directory, hf = gpt2_hf
    assert convert.main_import(["--from-hf", str(directory), "--to", str(tmp_path / "ckpt")]) == 0
    stored = load_tokenizer(tmp_path / "ckpt")
    assert (stored.vocab_size, stored.eos_id, stored.pad_id) == (50_257, 50_256, 50_256)
    assert convert.checkpoint_model_config(tmp_path / "ckpt").vocab_size == 50_257

    text, ids = eval_text(tmp_path, directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)(text.read_text()).input_ids
    assert ids == theirs and len(ids) > 2 * 64  # both read the directory alike; several windows
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), 64):
            window = torch.tensor([ids[start:start + 64]])
            if window.shape[1] > 1:
                total += hf(input_ids=window, labels=window).loss.item() * (window.shape[1] - 1)
                count += window.shape[1] - 1
    result = megalite_eval(tmp_path / "ckpt", text, capsys)
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(total / count, abs=1e-5)


# GPT-2's shape starts from the transformers model (its 50,257 rows); the Llamas from scratch.
MODES = {"gpt2": "padded", "llama2": "packed", "llama3": "padded"}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_prepare_train_at_tp2_dp2_and_evaluate(hf_tokenizers, corpus, gpt2_hf, tmp_path, name, capsys):
    tokenizer = hf_tokenizers[name]
    info = load_tokenizer(tokenizer)
    out = tmp_path / "prep"
    assert prepare.main(["--input", str(corpus), "--out", str(out), "--tokenizer", str(tokenizer),
                         "--workers", "0"]) == 0
    meta = json.loads((out / "meta.json").read_text())["tokenizer"]
    assert (meta["eos_id"], meta["bos_id"], meta["pad_id"]) == (info.eos_id, info.bos_id, info.eos_id)
    docs = prepare.prepare_data(DataConfig(path=str(out), val_fraction=0.0)).train[0].docs
    first = docs.documents(np.arange(3), 10**6)
    assert [d.tolist() for d in first] == info.encode_documents(TEXTS[:3])
    assert all(d[-1] == info.eos_id and (d[0] == info.bos_id) == (name != "gpt2") for d in first)

    run = tmp_path / "run"
    start = [f"train.init_from={gpt2_hf[0]}"] if name == "gpt2" else \
        ["model=tiny", "model.hidden=32", "model.dropout=0.0"]
    argv = start + [f"data.path={out}", f"data.mode={MODES[name]}", "data.seq_len=32",
                    "train.max_steps=2", "train.warmup_steps=1", "train.global_batch_size=8",
                    "train.micro_batch_size=2", "parallel.tp=2", "train.eval_tokens=64",
                    "sample.prompts=[The]", "sample.max_new_tokens=2", f"run.dir={run}"]
    assert run_distributed(run_train, 4, argv, torchrun_env=True) == [0] * 4
    ckpt = run / "checkpoints" / "step_00000002"
    stored = load_tokenizer(ckpt)
    assert (stored.names, stored.digest) == (info.names, info.digest)
    assert (stored.eos_id, stored.bos_id, stored.pad_id) == (info.eos_id, info.bos_id, info.eos_id)

    text, ids = eval_text(tmp_path, tokenizer)
    windows = math.ceil(len(ids) / convert.checkpoint_model_config(ckpt).max_seq_len)
    result = megalite_eval(ckpt, text, capsys)
    assert result["tokens"] == len(ids) - windows and math.isfinite(result["loss"])
