"""Training and evaluating on GPT-2-, Llama 2- and Llama 3-shaped tokenizers
(test_real_tokenizers.py builds them): prepare-data, a TP2xDP2 run whose first step is the
single process's, the checkpoint's stored tokenizer and megalite eval, each compared with a
computation made here.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megalite import evaluate
from megalite import plan
from megalite.prep import command as prepare
from megalite.data.batches import BatchOrder
from megalite.data.tokenizer import load_tokenizer
from megalite.hf import convert
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.run_config import DataConfig, given_keys, load_config
from megalite.training.checkpoint import load_checkpoint
from megalite.training.build import build_model
from megalite.run_setup import with_pretrained, with_tokenizer_vocab
from tests.support.harness import run_distributed
from tests.support.runs import losses, run_train
from tests.support.tokenizer_shapes import SHAPES, TEXTS
# The shapes' module fixtures, built once per module here too.


def eval_text(tmp_path, tokenizer) -> tuple[object, list[int]]:
    """A file of documents not trained on, and its ids as `tokenizer` encodes it."""
    text = tmp_path / "eval.txt"
    text.write_text("\n\n".join(TEXTS[300:302]))
    return text, load_tokenizer(tokenizer).encode(text.read_text())


def megalite_eval(ckpt, text, capsys) -> dict:
    capsys.readouterr()
    assert evaluate.main(["--ckpt", str(ckpt), "--text", str(text), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@torch.no_grad()
def windows_loss(loss_sum, ids: list[int], width: int) -> tuple[float, int]:
    """(mean loss, predicted tokens) over consecutive windows of `width` ids, each token after
    a window's first predicted within it, as megalite eval cuts a text; `loss_sum(window)`:
    the summed loss of a [1, n] window's n - 1 predictions."""
    total, count = 0.0, 0
    for start in range(0, len(ids), width):
        window = torch.tensor([ids[start:start + width]])
        if window.shape[1] > 1:
            total += float(loss_sum(window))
            count += window.shape[1] - 1
    return total / count, count


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


@pytest.mark.unit
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
    loss, count = windows_loss(lambda w: hf(input_ids=w, labels=w).loss * (w.shape[1] - 1), ids, 64)
    result = megalite_eval(tmp_path / "ckpt", text, capsys)
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(loss, abs=1e-5)


def first_step_loss(argv: list[str]) -> float:
    """Step 1's loss as one process computes it: the run's config at TP1, its data, its first
    global batch in one piece and its first weights (its init, or train.init_from's)."""
    cfg = with_pretrained(load_config(None, argv + ["parallel.tp=1"]), given_keys(None, argv))
    data = prepare.prepare_for_run(cfg.data)
    cfg = with_tokenizer_vocab(cfg, data)
    samples = plan.sample_sets(data.train, cfg, data)
    order = BatchOrder(samples.sizes, samples.weights, cfg.train.global_batch_size, cfg.run.seed)
    batch = samples.collate(order.global_batch_picks(0))
    model = build_model(cfg, ParallelState(), init=not cfg.train.init_from)
    if cfg.train.init_from:
        convert.load_pretrained(Path(cfg.train.init_from), model, ParallelState())
    with torch.no_grad():
        token_losses = model(batch.input_ids, doc_ids=batch.doc_ids, labels=batch.labels).token_losses
    return (token_losses.sum() / batch.target_count()).item()


# GPT-2's shape starts from the transformers model (its 50,257 rows); the Llamas from scratch.
MODES = {"gpt2": "padded", "llama2": "packed", "llama3": "padded"}


@pytest.mark.exactness
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_prepare_train_at_tp2_dp2_and_evaluate(hf_tokenizers, corpus, gpt2_hf, tmp_path, name, capsys):
    tokenizer = hf_tokenizers[name]
    info = load_tokenizer(tokenizer)
    out = tmp_path / "prep"
    assert prepare.main(["--input", str(corpus), "--out", str(out), "--tokenizer", str(tokenizer),
                         "--workers", "0"]) == 0
    meta = json.loads((out / "meta.json").read_text())["tokenizer"]
    assert (meta["eos_id"], meta["bos_id"], meta["pad_id"]) == (info.eos_id, info.bos_id, info.eos_id)
    docs = prepare.prepare_for_run(DataConfig(path=str(out), val_fraction=0.0)).train[0].docs
    first = docs.documents(np.arange(3), 10**6)
    assert [d.tolist() for d in first] == info.encode_documents(TEXTS[:3])
    assert all(d[-1] == info.eos_id and (d[0] == info.bos_id) == (name != "gpt2") for d in first)

    run = tmp_path / "run"
    start = [f"train.init_from={gpt2_hf[0]}"] if name == "gpt2" else ["model=tiny", "model.hidden=32"]
    argv = start + [f"data.path={out}", f"data.mode={MODES[name]}", "data.seq_len=32",
                    "model.dropout=0.0", "train.max_steps=2", "train.warmup_steps=1",
                    "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_tokens=64",
                    "sample.prompts=[The]", "sample.max_new_tokens=2", f"run.dir={run}"]
    assert run_distributed(run_train, 4, argv + ["parallel.tp=2"], torchrun_env=True) == [0] * 4
    # Its first step, over 2 DP ranks' micro-batches of TP-split models, is one process's.
    assert losses(run)[1] == pytest.approx(first_step_loss(argv), abs=1e-5)
    ckpt = run / "checkpoints" / "step_00000002"
    stored = load_tokenizer(ckpt)
    assert (stored.names, stored.digest) == (info.names, info.digest)
    assert (stored.eos_id, stored.bos_id, stored.pad_id) == (info.eos_id, info.bos_id, info.eos_id)

    # megalite eval encodes with the stored tokenizer as the source directory does, and scores
    # as the checkpoint's model does here.
    text, ids = eval_text(tmp_path, tokenizer)
    cfg = convert.checkpoint_model_config(ckpt)
    model = GPT(cfg, ParallelState(), init=False)
    load_checkpoint(ckpt, model, ParallelState())
    model.eval()
    loss, count = windows_loss(lambda w: model(w[:, :-1], labels=w[:, 1:]).token_losses.sum(),
                               ids, cfg.max_seq_len)
    result = megalite_eval(ckpt, text, capsys)
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(loss, abs=1e-5)
