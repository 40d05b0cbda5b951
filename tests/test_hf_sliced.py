"""Hugging Face weights read slice by slice, written tensor by tensor (hf/layout.py, hf/stream.py).

The reference is the code these replaced, kept here as `today_*`: every Hugging Face tensor read
whole as fp32, re-laid into whole megalite tensors, each rank keeping its slice.
"""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megalite.config import ParallelConfig
from megalite.data.tokenizer import load_tokenizer, train_bpe
from megalite.hf import llama
from megalite.hf.convert import (checkpoint_model_config, export_hf, import_hf,
                                 load_pretrained, pretrained_config, shard_names)
from megalite.hf.stream import HFFiles, SafetensorsWriter
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.training.checkpoint import load_checkpoint, load_full_weights
from tests.support.checkpoints import WeightsOnly, save_checkpoint
from tests.support.harness import run_distributed
from tests.support.models import padded_batch


def hf_lib():
    """transformers, imported by the tests that use it: not at import time, so that the ranks,
    which import this module to run their function, start in a fraction of a second."""
    return pytest.importorskip("transformers")


# ---- today's load (before slicing), verbatim: the reference ---------------------------------

def today_fuse_kv(k, v, kv_heads):
    rest = k.shape[1:]
    return torch.stack([k.reshape(kv_heads, -1, *rest), v.reshape(kv_heads, -1, *rest)], dim=1
                       ).reshape(-1, *rest)


def today_pad_rows(weight, rows):
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def today_gpt2(hf, cfg):
    layer = {"attn_norm.weight": ("ln_1.weight", False), "attn_norm.bias": ("ln_1.bias", False),
             "attn.out_proj.weight": ("attn.c_proj.weight", True),
             "attn.out_proj.bias": ("attn.c_proj.bias", False),
             "mlp_norm.weight": ("ln_2.weight", False), "mlp_norm.bias": ("ln_2.bias", False),
             "mlp.up.weight": ("mlp.c_fc.weight", True), "mlp.up.bias": ("mlp.c_fc.bias", False),
             "mlp.down.weight": ("mlp.c_proj.weight", True), "mlp.down.bias": ("mlp.c_proj.bias", False)}
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
    out = {"embed.weight": today_pad_rows(hf["wte.weight"], cfg.padded_vocab),
           "positions.weight": hf["wpe.weight"],
           "norm.weight": hf["ln_f.weight"], "norm.bias": hf["ln_f.bias"]}
    for i in range(cfg.n_layers):
        m, h = f"blocks.{i}.", f"h.{i}."
        out.update({m + ours: hf[h + theirs].T if transposed else hf[h + theirs]
                    for ours, (theirs, transposed) in layer.items()})
        for kind in ("weight", "bias"):
            fused = hf[h + f"attn.c_attn.{kind}"]
            q, k, v = (fused.T if kind == "weight" else fused).chunk(3)
            out[m + f"attn.q_proj.{kind}"] = q
            out[m + f"attn.kv_proj.{kind}"] = today_fuse_kv(k, v, cfg.kv_heads)
    return out


def today_llama(hf, cfg):
    out = {"embed.weight": today_pad_rows(hf["model.embed_tokens.weight"], cfg.padded_vocab),
           "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["head.weight"] = today_pad_rows(hf["lm_head.weight"], cfg.padded_vocab)
    for i in range(cfg.n_layers):
        m, h = f"blocks.{i}.", f"model.layers.{i}."
        out.update({m + ours: hf[h + theirs] for ours, theirs in llama.LAYER.items()})
        out[m + "attn.kv_proj.weight"] = today_fuse_kv(hf[h + "self_attn.k_proj.weight"],
                                                       hf[h + "self_attn.v_proj.weight"], cfg.kv_heads)
    return out


def today_read_hf(hf_dir):
    """(config, whole fp32 megalite tensors) as `read_hf` made them: every tensor read whole."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    tensors = {}
    for name in files:
        with safe_open(str(hf_dir / name), framework="pt") as f:
            tensors.update({k: f.get_tensor(k).float() for k in f.keys()})
    cfg = pretrained_config(hf_dir)
    return cfg, (today_gpt2 if cfg.positions.kind == "learned" else today_llama)(tensors, cfg)


# ---- tiny Hugging Face models -----------------------------------------------------------------

# name -> (config, dtype saved): GQA with n_kv_heads < tp and >= tp, tied and untied, a vocab
# whose padding spans two TP4 slices (260 of 384 rows), fp32 and bf16 files, one file and shards.
HF_MODELS = {
    "gpt2": (lambda: hf_lib().GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2,
                                             n_head=4, activation_function="gelu_new"), torch.float32),
    "llama-kv2-untied": (lambda: hf_lib().LlamaConfig(
        vocab_size=320, max_position_embeddings=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, rms_norm_eps=1e-5), torch.float32),
    "llama-kv4-tied-bf16": (lambda: hf_lib().LlamaConfig(
        vocab_size=260, max_position_embeddings=64, hidden_size=64, intermediate_size=80,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        tie_word_embeddings=True, rms_norm_eps=1e-5), torch.bfloat16),
    "llama-kv1-untied": (lambda: hf_lib().LlamaConfig(
        vocab_size=260, max_position_embeddings=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        tie_word_embeddings=False, rms_norm_eps=1e-5), torch.float32),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-models")
    tokenizer = root / "tokenizer.json"
    train_bpe(["tensor parallel training of language models " * 20], 260).save(str(tokenizer))
    dirs = {}
    for i, (name, (config, dtype)) in enumerate(HF_MODELS.items()):
        torch.manual_seed(i)
        model = hf_lib().AutoModelForCausalLM.from_config(config()).to(dtype)
        dirs[name] = root / name
        model.save_pretrained(dirs[name], max_shard_size="5GB" if name == "gpt2" else "60KB")
        (dirs[name] / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return dirs


# ---- sliced init_from == today's full read, then slice ---------------------------------------

class CountingFiles(HFFiles):
    """HFFiles counting the elements it reads."""
    elements = 0

    def read(self, name, index):
        piece = super().read(name, index)
        CountingFiles.elements += piece.numel()
        return piece


def compare_sliced_load(tp: int, pp: int, dirs: dict[str, str]) -> dict[str, int]:
    import megalite.hf.convert as convert
    convert.HFFiles = CountingFiles
    pipeline = ParallelConfig(tp=tp, pp=pp) if pp > 1 else None
    ps = ParallelState.from_world(tp, pipeline=pipeline)
    read = {}
    for name, path in dirs.items():
        cfg, full = today_read_hf(path)
        today = GPT(cfg, ps, seed=1)
        load_full_weights(full, today, path)
        ours = GPT(cfg, ps, seed=2)
        CountingFiles.elements = 0
        load_pretrained(Path(path), ours, ps)
        mine, theirs = dict(ours.named_parameters()), dict(today.named_parameters())
        assert mine.keys() == theirs.keys()
        for key, p in mine.items():
            assert p.dtype == theirs[key].dtype and torch.equal(p, theirs[key]), (name, key)
        # Only this rank's slices were read: its parameters less the vocab padding rows.
        start = ps.tp_rank * (cfg.padded_vocab // ps.tp_size)  # this rank's first vocab row
        padding = sum(max(0, min(start + p.shape[0], cfg.padded_vocab)
                          - max(start, cfg.vocab_size)) * p.shape[1]
                      for key, p in mine.items() if key in ("embed.weight", "head.weight"))
        assert CountingFiles.elements == sum(p.numel() for p in mine.values()) - padding, name
        read[name] = CountingFiles.elements
        # The imported (whole-tensor) checkpoint, read through get_slice, gives the same.
        legacy = GPT(cfg, ps, seed=3)
        load_checkpoint(path + "-imported", legacy, ps)
        for key, p in legacy.named_parameters():
            assert torch.equal(p, theirs[key]), (name, key)
    return read


@pytest.mark.exactness
@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (2, 2)])
def test_sliced_init_from_equals_the_full_read_then_slice(hf_dirs, tp, pp):
    for name, path in hf_dirs.items():
        if not Path(f"{path}-imported").is_dir():
            import_hf(path, Path(f"{path}-imported"))
    read = run_distributed(compare_sliced_load, tp * pp, tp, pp,
                           {k: str(v) for k, v in hf_dirs.items()})
    whole = {k: sum(v.numel() for v in load_file(Path(f"{p}-imported") / "model.safetensors").values())
             for k, p in hf_dirs.items()}
    for name in hf_dirs:
        # Every rank reads about 1/tp (plus replicated norms, and its stage's layers only).
        assert max(r[name] for r in read) < whole[name] * (0.6 if tp == 2 else 0.35), (name, read)


# ---- import: streamed, equal to today's -------------------------------------------------------

@pytest.mark.unit
def test_import_streams_the_same_tensors_as_todays_import(hf_dirs, tmp_path):
    for name, path in hf_dirs.items():
        cfg = import_hf(path, tmp_path / name)
        _, today = today_read_hf(path)
        written = load_file(tmp_path / name / "model.safetensors")  # safetensors' own reader
        assert written.keys() == today.keys(), name
        for key, tensor in today.items():
            assert written[key].dtype == torch.float32 and torch.equal(written[key], tensor), key
        assert checkpoint_model_config(tmp_path / name) == cfg


@pytest.mark.unit
def test_safetensors_writer_is_read_back_by_safetensors(tmp_path):
    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.randn(7),
               "ids": torch.arange(6).reshape(2, 3), "empty": torch.zeros(0, 4),
               "t": torch.randn(4, 6).T, "half": torch.randn(5).half()}
    specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    with SafetensorsWriter(tmp_path / "x.safetensors", specs, {"format": "pt"}) as writer:
        for k, v in tensors.items():
            writer.write(k, v)
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(ValueError, match="expected b"):
        with SafetensorsWriter(tmp_path / "y.safetensors", specs) as writer:
            writer.write("a", tensors["a"])


# ---- export: sharded, loads in transformers ---------------------------------------------------

@pytest.mark.unit
def test_shards_are_cut_as_transformers_cuts_them():
    assert shard_names({"a": 4, "b": 4, "c": 9, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]
    assert shard_names({"a": 4, "b": 4}, 100) == [["a", "b"]]


@pytest.mark.unit
@pytest.mark.parametrize("name,dtype,tol", [("gpt2", torch.float32, 1e-5), ("llama", torch.float32, 1e-5),
                                            ("gpt2", torch.bfloat16, 2e-2), ("llama", torch.bfloat16, 2e-2)])
def test_sharded_export_loads_in_transformers_with_megalites_loss(tmp_path, hf_dirs, name, dtype, tol):
    """A megalite checkpoint (DCP) exported in >= 2 shards: transformers' loss equals
    megalite's, to 1e-5 in fp32; bf16 rounds every weight (relative 2**-9), which moves the loss
    of these random models by a few 1e-3."""
    from tests.support.hf import MODELS
    cfg = dataclasses.replace(MODELS[name], init_std=0.1)
    model = GPT(cfg, ParallelState(), seed=21)
    meta = {"config": {"model": dataclasses.asdict(cfg)}, "tokens": 0}
    ckpt = save_checkpoint(tmp_path / "run", 0, model, WeightsOnly(), {"cpu": torch.get_rng_state()},
                           meta, ParallelState(), keep=1,
                           tokenizer=load_tokenizer(hf_dirs["gpt2"]))
    out = tmp_path / "hf"
    max_bytes = 20_000
    export_hf(ckpt, out, dtype, max_bytes)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files == sorted(p.name for p in out.glob("*.safetensors"))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    total = 0
    for file in files:
        tensors = load_file(out / file)
        assert {index["weight_map"][k] for k in tensors} == {file}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= max_bytes or len(tensors) == 1
        assert all(t.dtype == dtype for t in tensors.values())
        total += size
    assert index["metadata"]["total_size"] == total
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == str(dtype).removeprefix("torch.")

    hf = hf_lib().AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, mask, labels = padded_batch(cfg, "right", lengths=(20, 20, 20))
    with torch.no_grad():
        theirs = hf(input_ids=ids, labels=ids).loss
        losses = model(ids, labels=labels).token_losses
    ours = losses.sum() / (labels != -100).sum()
    assert abs(theirs.item() - ours.item()) <= tol, (theirs.item(), ours.item())


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gpt2", "llama-kv2-untied", "llama-kv4-tied-bf16"])
def test_import_then_export_gives_back_the_hugging_face_tensors(hf_dirs, tmp_path, name):
    """Through the whole-tensor checkpoint an import writes (the legacy read of export)."""
    import_hf(hf_dirs[name], tmp_path / "ckpt")
    _, dtype = HF_MODELS[name]
    export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype)
    original, exported = {}, {}
    for directory, into in ((hf_dirs[name], original), (tmp_path / "hf", exported)):
        for file in directory.glob("*.safetensors"):
            into.update(load_file(file))
    if name == "gpt2":
        original = {k: v for k, v in original.items() if ".attn.bias" not in k}
    assert exported.keys() == original.keys()
    assert all(exported[k].dtype == dtype and torch.equal(exported[k], v) for k, v in original.items())

