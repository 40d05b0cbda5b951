"""`megalite export --ckpt CKPT --to-hf OUT` and `megalite import --from-hf DIR --to CKPT`.

A megalite checkpoint is read whole in one process (training/checkpoint.read_whole_state), so
conversion is a renaming and re-laying of one tensor dictionary; no process group and no TP
size is involved. An imported checkpoint
(step 0, no optimizer state) loads at any TP size, and `train.init_from` starts training from
it or from a Hugging Face directory directly.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megalite.config import ModelConfig
from megalite.data.tokenizer import load_tokenizer
from megalite.hf import gpt2, llama
from megalite.typed_config import ConfigError, from_dict

ARCHITECTURES = {"GPT2LMHeadModel": gpt2, "LlamaForCausalLM": llama}


def checkpoint_model_config(ckpt: Path) -> ModelConfig:
    meta_file = Path(ckpt) / "meta.json"
    if not meta_file.is_file():
        raise ConfigError(f"'{ckpt}' is not a complete megalite checkpoint (no meta.json)")
    return from_dict(ModelConfig, json.loads(meta_file.read_text())["config"]["model"], "model.")


def exportable_as(cfg: ModelConfig) -> tuple[str, object]:
    errors = []
    for name, arch in ARCHITECTURES.items():
        try:
            arch.check_exportable(cfg)
            return name, arch
        except ConfigError as err:
            errors.append(str(err))
    raise ConfigError("; ".join(errors))


def _architecture(hf_dir: Path) -> tuple[dict, object]:
    """(config.json, architecture module) of a Hugging Face directory megalite can read."""
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"'{hf_dir}' has no config.json: not a Hugging Face model directory")
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    names = hf_cfg.get("architectures") or []
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(f"'{hf_dir}' is a {names or hf_cfg.get('model_type')} model: megalite "
                          f"imports {', '.join(ARCHITECTURES)}")
    return hf_cfg, arch


def export_hf(ckpt: Path, out: Path) -> str:
    ckpt, out = Path(ckpt), Path(out)
    cfg = checkpoint_model_config(ckpt)
    name, arch = exportable_as(cfg)
    tokenizer = load_tokenizer(ckpt / "tokenizer.json")
    special = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
               "pad_token_id": tokenizer.pad_id}
    from megalite.training.checkpoint import read_whole_state
    weights = read_whole_state(ckpt)
    hf = {k: v.contiguous() for k, v in arch.weights_to_hf(weights, cfg).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(
        {**arch.config_to_hf(cfg, special), "torch_dtype": "float32"}, indent=1))
    _write_tokenizer_files(ckpt / "tokenizer.json", tokenizer, out)
    return name


def _write_tokenizer_files(source: Path, tokenizer, out: Path) -> None:
    shutil.copy(source, out / "tokenizer.json")
    token = tokenizer.tokenizer.id_to_token
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token(tokenizer.bos_id),
        "eos_token": token(tokenizer.eos_id), "pad_token": token(tokenizer.pad_id),
        "add_bos_token": False, "add_eos_token": False}, indent=1))


def read_hf(hf_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], object]:
    """(megalite config, megalite full tensors, architecture module) of a HF directory."""
    hf_dir = Path(hf_dir)
    hf_cfg, arch = _architecture(hf_dir)
    cfg = arch.config_from_hf(hf_cfg)
    return cfg, arch.weights_from_hf(_hf_tensors(hf_dir), cfg), arch


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    index = hf_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    tensors = {}
    for name in files:
        if not (hf_dir / name).is_file():
            raise ConfigError(f"'{hf_dir / name}' is missing: megalite reads safetensors weights")
        with safe_open(str(hf_dir / name), framework="pt") as f:
            tensors.update({k: f.get_tensor(k).float() for k in f.keys()})
    return tensors


def import_hf(hf_dir: Path, ckpt: Path) -> ModelConfig:
    hf_dir, ckpt = Path(hf_dir), Path(ckpt)
    cfg, weights, _ = read_hf(hf_dir)
    if not (hf_dir / "tokenizer.json").is_file():
        raise ConfigError(f"'{hf_dir}' has no tokenizer.json: megalite needs the fast tokenizer "
                          f"file to train, evaluate and generate with the imported model")
    check_tokenizer_matches(load_tokenizer(hf_dir / "tokenizer.json"), cfg, hf_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(ckpt / "model.safetensors"))
    shutil.copy(hf_dir / "tokenizer.json", ckpt / "tokenizer.json")
    (ckpt / "meta.json").write_text(json.dumps({"step": 0, "tokens": 0, "source": str(hf_dir),
                                                "config": {"model": dataclasses.asdict(cfg)}}, indent=1))
    return cfg


def pretrained_config(path: Path) -> ModelConfig:
    """The model config of a megalite checkpoint or a Hugging Face directory."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return checkpoint_model_config(path)
    hf_cfg, arch = _architecture(path)
    return arch.config_from_hf(hf_cfg)


def load_pretrained(path: Path, model, pstate) -> None:
    """Weights of a megalite checkpoint or a Hugging Face directory into this rank's slices."""
    from megalite.training.checkpoint import load_checkpoint, load_full_weights
    path = Path(path)
    if (path / "meta.json").is_file():
        load_checkpoint(path, model, pstate)
    else:
        load_full_weights(read_hf(path)[1], model, str(path))


def check_tokenizer_matches(tokenizer, cfg: ModelConfig, where) -> None:
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"the tokenizer of '{where}' has {tokenizer.vocab_size} tokens but the "
                          f"model's vocabulary has {cfg.vocab_size} rows: use the tokenizer that "
                          f"was trained with this model")


def main_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megalite export")
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--to-hf", required=True, dest="out")
    args = parser.parse_args(argv)
    print(f"wrote {export_hf(Path(args.ckpt), Path(args.out))} to {args.out}")
    return 0


def main_import(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megalite import")
    parser.add_argument("--from-hf", required=True, dest="hf_dir")
    parser.add_argument("--to", required=True, dest="ckpt")
    args = parser.parse_args(argv)
    cfg = import_hf(Path(args.hf_dir), Path(args.ckpt))
    print(f"imported {args.hf_dir} ({cfg.n_layers} layers, hidden {cfg.hidden}) to {args.ckpt}")
    return 0
