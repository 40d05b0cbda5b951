"""`megalite export --ckpt CKPT --to-hf OUT` and `megalite import --from-hf DIR --to CKPT`,
and `train.init_from=HF_DIR`.

Each architecture's recipe (hf/layout.py) describes every megalite tensor as rows of Hugging
Face tensors; all three follow it, one tensor at a time, without a process group:
- `train.init_from`: each rank reads only its TP slice of its own parameters, through
  safetensors' get_slice (training/checkpoint.load_full_weights on a `MegaliteView`);
- import: one megalite tensor made at a time, streamed into the checkpoint's model.safetensors
  (whole tensors, fp32; the checkpoint loads at any layout, step 0, no optimizer state);
- export: one megalite tensor read at a time from the checkpoint, one Hugging Face tensor
  made at a time, streamed into sharded safetensors files (bf16 unless asked for fp32).
"""
import dataclasses
import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from megalite.command_args import export_parser, import_parser
from megalite.config import ModelConfig
from megalite.flat_keys import nest
from megalite.data.tokenizer import KNOWN, TokenizerInfo, load_tokenizer, save_tokenizer
from megalite.hf import (deepseek_v3, gemma3, gpt2, llama, mistral, mixtral, qwen2, qwen2_moe,
                         qwen3, qwen3_moe)
from megalite.hf.expressible import check_expressible
from megalite.hf.layout import HFPlan, MegaliteView
from megalite.hf.stream import HFFiles, SafetensorsWriter
from megalite.typed_config import ConfigError, from_dict

# Every architecture megalite reads and writes, by its Hugging Face class: each module is its
# recipe (NAME; NEEDS and FREE, the model settings it fixes and carries: hf/expressible.py;
# config_to_hf, config_from_hf; recipe, its tensors as Hugging Face's: hf/layout.py). An export
# without model.architecture takes the first that holds the config.
ARCHITECTURES = {arch.NAME: arch for arch in (gpt2, llama, mistral, qwen2, qwen3, gemma3, mixtral,
                                               qwen2_moe, qwen3_moe, deepseek_v3)}


def checkpoint_model_config(ckpt: Path) -> ModelConfig:
    from megalite.training.checkpoint_dirs import not_a_checkpoint
    if wrong := not_a_checkpoint(ckpt):
        raise ConfigError(wrong)
    return saved_model_config(json.loads((Path(ckpt) / "meta.json").read_text()))


def saved_model_config(meta: dict) -> ModelConfig:
    """The model of a checkpoint's meta.json (of before the sections too: flat_keys.py)."""
    return from_dict(ModelConfig, nest(meta["config"]["model"], note=False), "model.")


def exportable_as(cfg: ModelConfig) -> tuple[str, object]:
    """(name, module) of model.architecture, or without one of the first architecture that
    holds the config; a ConfigError with each one's reasons if none does."""
    if cfg.architecture not in (None, *ARCHITECTURES):
        raise ConfigError(f"model.architecture={cfg.architecture!r} is not one megalite "
                          f"writes: use one of {', '.join(ARCHITECTURES)}, or null")
    errors = []
    for name in [cfg.architecture] if cfg.architecture else ARCHITECTURES:
        wrong = check_expressible(cfg, ARCHITECTURES[name])
        if not wrong:
            return name, ARCHITECTURES[name]
        errors.append(f"not exportable as {name}: " + "; ".join(wrong))
    raise ConfigError("; ".join(errors))


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GB = 10**9  # transformers' max_shard_size="5GB" is 5 * 10**9 bytes


def shard_names(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensors in order, cut into files of at most max_bytes (a larger tensor alone), as
    transformers' save_pretrained does."""
    shards: list[list[str]] = []
    total = 0
    for name, size in sizes.items():
        if not shards or total + size > max_bytes:  # a shard is never left empty here
            shards.append([])
            total = 0
        shards[-1].append(name)
        total += size
    return shards


def special_ids(tokenizer: TokenizerInfo) -> dict[str, int | None]:
    """config.json's bos/eos/pad_token_id: bos is eos where the tokenizer has none (as GPT-2's
    config says: 50256 for both); null, not left out, for a pad it lacks (transformers would
    default to GPT-2's id)."""
    names = {"bos_token": tokenizer.names["eos_token"], **tokenizer.names}
    return {f"{key}_id": tokenizer.tokenizer.token_to_id(names[key]) if key in names else None
            for key in KNOWN}


def export_hf(ckpt: Path, out: Path, dtype: torch.dtype = torch.bfloat16,
              max_shard_bytes: int = 5 * GB) -> str:
    """Write a Hugging Face directory: config.json, the tokenizer files, and the weights as
    `dtype` in safetensors files of at most max_shard_bytes (model-0000i-of-0000N.safetensors
    and model.safetensors.index.json, or model.safetensors alone when one file holds them, as
    save_pretrained names them). Streams: one Hugging Face tensor is made at a time, from one
    megalite tensor read at a time."""
    ckpt, out = Path(ckpt), Path(out)
    cfg = checkpoint_model_config(ckpt)
    name, arch = exportable_as(cfg)
    tokenizer = load_tokenizer(ckpt)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # out, or a folder above it, is a file
        file = next(p for p in (out, *out.parents) if p.exists())
        raise ConfigError(f"'{file}' is a file: give --to-hf a directory (a new one, or an "
                          f"earlier export's, whose model files are replaced)") from None
    for old in [*out.glob("model-*-of-*.safetensors"), out / "model.safetensors",
                out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # an earlier export's, which a loader could pick instead
    from megalite.training.checkpoint import CheckpointTensors
    stored = CheckpointTensors(ckpt)
    plan = HFPlan(arch.recipe(cfg), stored.shape, stored.read)
    sizes = {k: math.prod(shape) * dtype.itemsize for k, shape in plan.shapes.items()}
    shards = shard_names(sizes, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, names in zip(files, shards):
        with SafetensorsWriter(out / file, {k: (plan.shapes[k], dtype) for k in names},
                               {"format": "pt"}) as writer:
            for k in names:
                writer.write(k, plan.make(k, dtype))
    if len(shards) > 1:
        total = sum(sizes.values())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total, "total_parameters": total // dtype.itemsize},
             "weight_map": {k: file for file, names in zip(files, shards) for k in names}},
            indent=1))
    dtype_name = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(
        {**arch.config_to_hf(cfg, special_ids(tokenizer)), "torch_dtype": dtype_name, "dtype": dtype_name},
        indent=1))
    save_tokenizer(tokenizer, out)
    return name


@contextmanager
def hf_weights(hf_dir: Path, dtype: torch.dtype | None = torch.float32
               ) -> Iterator[tuple[ModelConfig, MegaliteView]]:
    """(megalite config, megalite tensors as `dtype`, None: as stored) of a Hugging Face
    directory, read lazily from its files: a whole tensor or a TP slice of one reads only its
    parts of the files."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"'{hf_dir}' has no config.json: not a Hugging Face model directory")
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    names = hf_cfg.get("architectures") or []
    name = next((n for n in names if n in ARCHITECTURES), None)
    if name is None:
        raise ConfigError(f"'{hf_dir}' is a {names or hf_cfg.get('model_type')} model: megalite "
                          f"imports {', '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[name]
    cfg = dataclasses.replace(arch.config_from_hf(hf_cfg), architecture=name)
    with HFFiles(hf_dir, getattr(arch, "canonical", lambda name: name)) as files:
        yield cfg, MegaliteView(arch.recipe(cfg), files, dtype)


def import_hf(hf_dir: Path, ckpt: Path, eos_token: str | None = None) -> ModelConfig:
    """Write a checkpoint in the whole-tensor format (fp32 model.safetensors), one tensor at a
    time: the whole model is never in memory. The tokenizer is stored with its special tokens
    named (`eos_token`, where the directory's files do not name one)."""
    hf_dir, ckpt = Path(hf_dir), Path(ckpt)
    with hf_weights(hf_dir) as (cfg, weights):
        if not (hf_dir / "tokenizer.json").is_file():
            raise ConfigError(f"'{hf_dir}' has no tokenizer.json: megalite needs the fast tokenizer "
                              f"file to train, evaluate and generate with the imported model")
        tokenizer = load_tokenizer(hf_dir, eos_token)
        check_tokenizer_matches(tokenizer, cfg, hf_dir)
        present = set(weights.keys())
        if missing := [k for k in weights.recipe if k not in present]:
            raise ConfigError(f"'{hf_dir}' lacks the tensors of {missing[:4]}: it does not hold "
                              f"the model its config.json describes")
        ckpt.mkdir(parents=True, exist_ok=True)
        specs = {k: (tuple(weights.shape(k)), torch.float32) for k in weights.recipe}
        with SafetensorsWriter(ckpt / "model.safetensors", specs, {"format": "pt"}) as writer:
            for k in specs:
                writer.write(k, weights.read(k, slice(None)))
                weights.source.release()  # the pages read so far, out of this process's memory
    save_tokenizer(tokenizer, ckpt)
    (ckpt / "meta.json").write_text(json.dumps({"step": 0, "tokens": 0, "source": str(hf_dir),
                                                "config": {"model": dataclasses.asdict(cfg)}}, indent=1))
    return cfg


def pretrained_config(path: Path) -> ModelConfig:
    """The model config of a megalite checkpoint or a Hugging Face directory (its safetensors
    files opened: a cut-off one stops every rank here, before any collective)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return checkpoint_model_config(path)
    with hf_weights(path) as (cfg, _):
        return cfg


def pretrained_model(path: str) -> dict:
    """The model mapping of a megalite checkpoint or a Hugging Face directory (run_config.load_config's
    base under train.init_from)."""
    return json.loads(json.dumps(dataclasses.asdict(pretrained_config(Path(path)))))


def load_pretrained(path: Path, model, pstate) -> None:
    """Weights of a megalite checkpoint or a Hugging Face directory into this rank's slices."""
    from megalite.training.checkpoint import load_checkpoint, load_full_weights
    path = Path(path)
    if (path / "meta.json").is_file():
        load_checkpoint(path, model, pstate)
    else:
        # Each rank reads only its slices of its own parameters (its pipeline stage's), and
        # copies them into the parameters as they are stored (no fp32 copy of each first).
        with hf_weights(path, dtype=None) as (_, weights):
            load_full_weights(weights, model, str(path))


def check_tokenizer_matches(tokenizer, cfg: ModelConfig, where) -> None:
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"the tokenizer of '{where}' has {tokenizer.vocab_size} tokens but the "
                          f"model's vocabulary has {cfg.vocab_size} rows: use the tokenizer that "
                          f"was trained with this model")


def main_export(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)
    name = export_hf(Path(args.ckpt), Path(args.out), DTYPES[args.dtype],
                     int(args.max_shard_gb * GB))
    print(f"wrote {name} to {args.out}")
    return 0


def main_import(argv: list[str]) -> int:
    args = import_parser().parse_args(argv)
    cfg = import_hf(Path(args.hf_dir), Path(args.ckpt), args.eos_token)
    print(f"imported {args.hf_dir} ({cfg.n_layers} layers, hidden {cfg.hidden}) to {args.ckpt}")
    return 0
