"""Hugging Face interop, checked against transformers itself (CPU, fp32)."""
import dataclasses
import json
from itertools import islice

import pytest
import torch
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")

from megalite.data.raw_files import EMBEDDED
from megalite.prep.sources import documents  # noqa: E402
from megalite.data.tokenizer import load_tokenizer, train_bpe  # noqa: E402
from megalite.config import ParallelConfig  # noqa: E402
from megalite.hf.convert import checkpoint_model_config, export_hf, import_hf  # noqa: E402
from megalite.model import GPT  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from megalite.plan import check_layout  # noqa: E402
from megalite.training.checkpoint import load_checkpoint  # noqa: E402
from megalite.typed_config import ConfigError, replaced  # noqa: E402
from tests.support.checkpoints import WeightsOnly, read_whole_state, save_checkpoint  # noqa: E402
from tests.support.harness import run_distributed  # noqa: E402
from tests.support.hf import MODELS, random_hf_model, run_cli  # noqa: E402
from tests.support.models import padded_batch  # noqa: E402

TOL = dict(atol=1e-4, rtol=1e-4)


def batch(cfg):
    ids, mask, _ = padded_batch(cfg, "right")
    return ids, mask


def megalite_checkpoint(cfg, tokenizer_file, directory):
    model = GPT(cfg, ParallelState(), seed=21)
    ps = ParallelState()
    meta = {"config": {"model": dataclasses.asdict(cfg)}, "tokens": 0}
    path = save_checkpoint(directory, 0, model, WeightsOnly(), {"cpu": torch.get_rng_state()}, meta,
                           ps, keep=1, tokenizer=load_tokenizer(tokenizer_file))
    return model, path


@pytest.mark.unit
@pytest.mark.parametrize("name,arch", [("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")])
def test_exported_model_gives_megalites_logits_in_transformers(tmp_path, tokenizer_file, name, arch):
    model, ckpt = megalite_checkpoint(MODELS[name], tokenizer_file, tmp_path / "run")
    assert export_hf(ckpt, tmp_path / "hf", torch.float32) == arch
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == ["model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    ids, mask = batch(model.cfg)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
        ours = model.full_logits(model(ids).logits)
    real = mask.bool()
    assert_close(theirs[real], ours[real], **TOL)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.pad_token_id == 2 and tok.eos_token_id == 0


def check_imported_logits(tp: int, ckpt: str, ids, mask):
    ps = ParallelState.from_world(tp) if tp > 1 else ParallelState()
    cfg = checkpoint_model_config(ckpt)
    model = GPT(cfg, ps, seed=1)
    load_checkpoint(ckpt, model, ps)
    with torch.no_grad():
        return model.full_logits(model(ids, attention_mask=mask).logits)


@pytest.mark.exactness
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_imported_transformers_model_gives_its_logits_at_tp_1_2_4(tmp_path, tokenizer_file, name):
    hf = random_hf_model(name, tmp_path / "hf", tokenizer_file)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == (name == "llama")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    ids, mask = batch(MODELS[name])
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert_close(check_imported_logits(1, str(tmp_path / "ckpt"), ids, mask)[real], theirs[real], **TOL)
    for tp in (2, 4):
        ours = run_distributed(check_imported_logits, tp, tp, str(tmp_path / "ckpt"), ids, mask)[0]
        assert_close(ours[real], theirs[real], **TOL)


@pytest.mark.unit
def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"],
                                                      "model_type": "bert"}))
    with pytest.raises(ConfigError, match=r"is a \['BertForMaskedLM'\] model: megalite imports GPT2LMHeadModel, LlamaForCausalLM"):
        import_hf(tmp_path, tmp_path / "ckpt")


@pytest.mark.unit
def test_tokenizer_larger_than_the_vocab_is_refused(tmp_path, tokenizer_file):
    random_hf_model("gpt2", tmp_path / "hf", tokenizer_file)
    big = train_bpe(list(islice(documents(EMBEDDED), 300)), 400)
    big.save(str(tmp_path / "hf" / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"tokenizer of .* has 400 tokens but the model's vocabulary has 320 rows"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")


@pytest.mark.unit
def test_half_written_checkpoint_is_refused(tmp_path):
    (tmp_path / "step_00000003").mkdir()
    with pytest.raises(ConfigError, match="is not a complete megalite checkpoint"):
        export_hf(tmp_path / "step_00000003", tmp_path / "hf")


@pytest.mark.unit
def test_tp_that_does_not_divide_the_heads_of_an_imported_model_is_refused(tmp_path, tokenizer_file):
    random_hf_model("gpt2", tmp_path / "hf", tokenizer_file)
    cfg = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"parallel\.tp=3 must divide the model.s heads \(4\)"):
        check_layout(cfg, ParallelConfig(tp=3), 3)  # the plan's check: generate's, eval's, a run's


@pytest.mark.unit
@pytest.mark.parametrize("option,message", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"scale_attn_weights": False}, "scale_attn_weights=false"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
])
def test_gpt2_options_megalite_does_not_compute_are_refused(tmp_path, tokenizer_file, option, message):
    random_hf_model("gpt2", tmp_path / "hf", tokenizer_file)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **option}))
    with pytest.raises(ConfigError, match=f"unsupported GPT-2 checkpoint: {message}"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")


@pytest.mark.unit
def test_non_gpt2_or_llama_shapes_are_not_exported(tmp_path, tokenizer_file):
    odd = replaced(MODELS["gpt2"], "norms.kind", "rmsnorm")
    _, ckpt = megalite_checkpoint(odd, tokenizer_file, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"not exportable as GPT2LMHeadModel: model\.norms\.kind='rmsnorm'"):
        export_hf(ckpt, tmp_path / "hf")


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_eval_command_equals_the_same_computation_in_transformers(tmp_path, tokenizer_file, name):
    hf = random_hf_model(name, tmp_path / "hf", tokenizer_file)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    text = tmp_path / "text.txt"
    text.write_text("tensor parallel training of language models, " * 40)  # > 2 windows of 64
    result = json.loads(run_cli("eval", "--ckpt", str(tmp_path / "ckpt"), "--text", str(text),
                                "--json").strip().splitlines()[-1])

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok(text.read_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), 64):
            window = ids[start:start + 64].unsqueeze(0)
            if window.shape[1] > 1:
                total += hf(input_ids=window, labels=window).loss.item() * (window.shape[1] - 1)
                count += window.shape[1] - 1
    assert len(ids) > 128 and result["tokens"] == count
    assert result["loss"] == pytest.approx(total / count, abs=1e-4)


@pytest.mark.exactness
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_generation_at_tp2_equals_transformers_generate(tmp_path, tokenizer_file, name):
    # A larger init than 0.02, so that the greedy continuation is not one token repeated.
    cfg = dataclasses.replace(MODELS[name], init_std=0.3)
    model, ckpt = megalite_checkpoint(cfg, tokenizer_file, tmp_path / "run")
    export_hf(ckpt, tmp_path / "hf", torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    prompt = [17, 45, 3, 99, 120]
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
    ours = run_distributed(generate_at_tp2, 2, str(ckpt), prompt)[0]
    assert ours == theirs and len(set(theirs)) > 3


def generate_at_tp2(ckpt: str, prompt):
    from megalite.generate import generate
    ps = ParallelState.from_world(2)
    model = GPT(checkpoint_model_config(ckpt), ps, seed=5)
    load_checkpoint(ckpt, model, ps)
    return generate(model, [prompt], 12, pad_id=2)[0]


@pytest.mark.exactness
def test_training_starts_from_a_hugging_face_directory(tmp_path, tokenizer_file):
    """train.init_from=HF_DIR at TP=2: with lr 0, the final weights are the imported ones."""
    from safetensors.torch import load_file

    from megalite.train import main
    from tests.support.runs import run_train
    random_hf_model("gpt2", tmp_path / "hf", tokenizer_file)
    import_hf(tmp_path / "hf", tmp_path / "imported")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": "tensor parallel training " * 8}) + "\n" for _ in range(40)))
    argv = [f"train.init_from={tmp_path / 'hf'}", f"data.path={corpus}", "data.seq_len=32",
            "data.val_fraction=0.0", f"data.cache_dir={tmp_path / 'cache'}", "parallel.tp=2",
            "train.max_steps=1", "train.lr=0.0", "train.min_lr=0.0", "train.global_batch_size=2",
            "train.micro_batch_size=2", "sample.max_new_tokens=2", f"run.dir={tmp_path / 'run'}"]
    assert run_distributed(run_train, 2, argv, torchrun_env=True) == [0, 0]
    final = read_whole_state(tmp_path / "run" / "checkpoints" / "step_00000001")
    imported = load_file(tmp_path / "imported" / "model.safetensors")
    assert final.keys() == imported.keys()
    assert all(torch.equal(final[k], imported[k]) for k in final)

    big = tmp_path / "big.json"
    train_bpe(list(islice(documents(EMBEDDED), 300)), 400).save(str(big))
    with pytest.raises(ConfigError, match="has 400 tokens but the model's vocabulary has 320 rows"):
        main(argv + [f"data.tokenizer={big}", "parallel.tp=1"])
