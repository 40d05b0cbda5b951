"""Hugging Face helpers: the vocabulary and models of the interop tests, a random transformers
model saved with a tokenizer, `megalite ARGS` run in this process, the loss transformers gives
over eval's windows, and the check that an imported checkpoint evaluates, exports and
generates as transformers does."""
import dataclasses
import json

import pytest
import tokenizers
import torch

from megalite.hf.convert import checkpoint_model_config
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.training.checkpoint import load_checkpoint
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS

transformers = pytest.importorskip("transformers")


VOCAB = 320
MODELS = {
    "gpt2": dataclasses.replace(CONFIGS["gpt2"], vocab_size=VOCAB, max_seq_len=64),
    "llama": dataclasses.replace(CONFIGS["llama"], vocab_size=VOCAB, max_seq_len=64),
}


def random_hf_model(name: str, directory, tokenizer_file):
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                         n_head=4, activation_function="gelu_new")
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64,
                                          hidden_size=32, intermediate_size=48,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, tie_word_embeddings=False,
                                          rms_norm_eps=1e-5)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Llama is saved in shards (with model.safetensors.index.json), GPT-2 in one file.
    model.save_pretrained(directory, max_shard_size="40KB" if name == "llama" else "5GB")
    (directory / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    return model


def run_cli(*args):
    """What `megalite ARGS` prints, run in this process (a launch would only add imports)."""
    import io
    from contextlib import redirect_stdout

    from megalite.cli import main
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


CONTEXT = 64


def transformers_loss(hf, ids: torch.Tensor) -> tuple[float, int]:
    """The mean next-token loss over consecutive windows of CONTEXT tokens, as megalite eval
    cuts a text, and the tokens predicted."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), CONTEXT):
            window = ids[start:start + CONTEXT].unsqueeze(0)
            if window.shape[1] > 1:
                total += hf(input_ids=window, labels=window).loss.item() * (window.shape[1] - 1)
                count += window.shape[1] - 1
    return total / count, count


def generate_at_tp2(ckpt: str, prompt):
    from megalite.generate import generate
    ps = ParallelState.from_world(2)
    model = GPT(checkpoint_model_config(ckpt), ps, init=False)
    load_checkpoint(ckpt, model, ps)
    return generate(model, [prompt], 20, pad_id=2)[0]


def same_as_transformers(hf, tmp_path, eps: list[list[str]]) -> None:
    """The checkpoint imported at tmp_path/ckpt from tmp_path/hf: `megalite eval --tp 2` (with
    each of `eps`' options) on ranks with torchrun's environment gives transformers' loss;
    exported in fp32, transformers reads the same model; greedy generation at TP2 equals
    transformers'."""
    text = tmp_path / "text.txt"
    text.write_text("tensor parallel training of language models, " * 30)  # > 2 windows
    # The tokenizer file itself: AutoTokenizer would pick each family's class (Gemma's wants
    # an <unk> this small BPE lacks).
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    ids = torch.tensor(tok.encode(text.read_text(), add_special_tokens=False).ids)
    loss, count = transformers_loss(hf, ids)
    assert len(ids) > 2 * CONTEXT
    for ep in eps:
        printed = run_distributed(run_cli, 4 if ep else 2, "eval", "--ckpt", str(tmp_path / "ckpt"),
                                  "--text", str(text), "--tp", "2", *ep, "--json",
                                  torchrun_env=True)[0]
        result = json.loads(printed.strip().splitlines()[-1])
        assert result["tokens"] == count and result["loss"] == pytest.approx(loss, abs=1e-5), ep

    assert f"wrote {type(hf).__name__}" in run_cli("export", "--ckpt", str(tmp_path / "ckpt"),
                                                   "--to-hf", str(tmp_path / "out"), "--dtype", "fp32")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(back) is type(hf)
    assert transformers_loss(back, ids)[0] == pytest.approx(loss, abs=1e-6)

    prompt = [17, 45, 3, 99, 120]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                         eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
    ours = run_distributed(generate_at_tp2, 2, str(tmp_path / "ckpt"), prompt)[0]
    assert ours == theirs and len(set(theirs)) > 3
