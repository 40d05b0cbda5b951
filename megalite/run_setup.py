"""Everything decided before the process group exists: the batch layout, the pretrained
source, the tokenizer's vocabulary, and which checkpoint (if any) a run resumes from.

Each check runs on every rank from the same files, so a bad run stops everywhere with the same
ConfigError and no rank is left waiting in a collective.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

from megalite.config import TRAINING_SETTINGS, ModelConfig
from megalite.flat_keys import nest
from megalite.layout_rules import check_layout, data_parallel_size
from megalite.data.prepared import PreparedData
from megalite.fp8.convert import check_fp8_layout
from megalite.hf.convert import check_tokenizer_matches, pretrained_config
from megalite.parallel.context import context_chunks
from megalite.run_config import Config, TrainConfig, to_dict
from megalite.training.build import inductor_options
from megalite.training.checkpoint_dirs import checkpoint_step, latest_checkpoint, not_a_checkpoint
from megalite.training.deepspeed_engine import check_deepspeed
from megalite.typed_config import ConfigError, from_dict, leaves, replaced


def validate(cfg: Config, world: int, launched: bool = True, installed: bool = True,
             vocab_from_tokenizer: bool = False) -> None:
    """Every rule a run's config must meet on `world` processes (launched: under torchrun or
    Slurm, with a process group to come), checked by every entry point that runs or plans a
    run (train, a bench point, a sweep) before it reads data or joins a collective.
    installed: also that the packages it needs (wandb, deepspeed) are installed here; false
    where the run happens elsewhere (a sweep planned on a login node).
    vocab_from_tokenizer: model.vocab_size will be the tokenizer's (with_tokenizer_vocab), so
    its split over tp waits for check_data, which names the real one."""
    parallel, t = cfg.parallel, cfg.train
    dp = data_parallel_size(parallel, world)  # if that does not divide, check_layout says so
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp) if t.micro_batch_size > 0 else None
    check_layout(cfg.model, parallel, world, micro_batches, vocab=not vocab_from_tokenizer)
    if not parallel.dp_bucket_mb > 0:
        raise ConfigError(f"parallel.dp_bucket_mb={parallel.dp_bucket_mb} must be > 0: it is the size of "
                          f"a DP gradient bucket in MiB; use e.g. 25 (PyTorch DDP's default)")
    if t.engine == "native" and t.zero_stage == 2:
        raise ConfigError("train.zero_stage=2 with train.engine=native: the native engine "
                          "partitions the optimizer state (stage 1), not the gradients; use "
                          "train.zero_stage=1, or train.engine=deepspeed for stage 2")
    if parallel.ep > 1 and t.engine == "deepspeed":
        raise ConfigError(f"parallel.ep={parallel.ep} with train.engine=deepspeed: DeepSpeed's ZeRO would "
                          f"sum the experts' gradients over every DP rank, not the ranks holding "
                          f"the same experts; use train.engine=native (train.zero_stage 0 or 1)")
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} and "
                          f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    split = (f"tp {parallel.tp}" if parallel.pp == parallel.cp == 1 else
             f"(tp x cp x pp) {parallel.tp * parallel.cp * parallel.pp}")
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={t.micro_batch_size} x DP={dp} (world {world} / {split}): "
            f"use a global batch that is a multiple of "
            f"{t.micro_batch_size * dp}, so every DP rank runs whole micro-batches")
    if cfg.data.seq_len < 1:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} must be >= 1: the tokens of a training row")
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len="
                          f"{cfg.model.max_seq_len}: lower data.seq_len or raise max_seq_len")
    chunks = context_chunks(parallel.cp, parallel.tp, parallel.sequence_parallel)
    if cfg.data.seq_len % chunks:
        sp = " x parallel.tp (sequence parallel)" if parallel.sequence_parallel else ""
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} with parallel.cp={parallel.cp}: each row is cut "
                          f"into 2 x parallel.cp{sp} = {chunks} equal chunks, so data.seq_len must be a "
                          f"multiple of {chunks}: use data.seq_len={cfg.data.seq_len + chunks - cfg.data.seq_len % chunks}")
    if installed and cfg.run.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.wandb=true needs the wandb package: pip install 'megalite[wandb]', "
                          "or set run.wandb=false")
    for key in ("max_steps", "keep_checkpoints", "log_every", "loss_chunk_tokens"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 1")
    for key, zero in (("eval_tokens", "the whole held-out set"), ("decay_steps", "train.max_steps")):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be >= 0 (0: {zero})")
    if t.profile_steps is not None and not 1 <= t.profile_steps[0] <= t.profile_steps[1] <= t.max_steps:
        raise ConfigError(f"train.profile_steps={list(t.profile_steps)} must be [first, last] optimizer "
                          f"steps with 1 <= first <= last <= train.max_steps={t.max_steps}")
    check_ranges(t)
    if t.fp8.recipe != "none" and installed and importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"train.fp8.recipe={t.fp8.recipe} needs the torchao package: pip install "
                          f"'torchao>=0.18', or set train.fp8.recipe=none")
    check_fp8_layout(cfg)
    if any(not part for part in t.fp8.exclude):
        raise ConfigError(f"train.fp8.exclude={list(t.fp8.exclude)} has an empty entry, which would "
                          f"exclude every layer: list name parts such as out_proj, or none")
    check_deepspeed(t, cfg.model, parallel, world if launched else None, installed)


def check_run_dir(run_dir: Path) -> None:
    """Every rank writes its share of each checkpoint into run.dir: one it cannot write (a
    read-only or full filesystem, a path through a file) is bad input, found before the
    process group exists."""
    probe = run_dir / f".writable.{os.environ.get('RANK', '0')}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"megalite")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"run.dir '{run_dir}' cannot be written ({err.strerror or err}): "
                          f"give a run.dir on a writable filesystem with room for the "
                          f"checkpoints") from None


def check_ranges(t: TrainConfig) -> None:
    """The numbers an optimizer or schedule would take in a form of its own (torch reports a
    bad lr as the scheduled value, not the one typed): each named with the value given."""
    rules = [("train.lr", t.lr, t.lr >= 0, ">= 0"), ("train.min_lr", t.min_lr, t.min_lr >= 0, ">= 0"),
             ("train.warmup_steps", t.warmup_steps, t.warmup_steps >= 0, ">= 0 (0: no warmup)"),
             ("train.epochs", t.epochs, 0 <= t.epochs < math.inf, ">= 0 (0: train.max_steps)"),
             ("train.weight_decay", t.weight_decay, t.weight_decay >= 0, ">= 0"),
             ("train.beta1", t.beta1, 0 <= t.beta1 < 1, "in [0, 1), e.g. 0.9"),
             ("train.beta2", t.beta2, 0 <= t.beta2 < 1, "in [0, 1), e.g. 0.95"),
             ("train.grad_clip", t.grad_clip, t.grad_clip >= 0, ">= 0 (0: no clipping)"),
             ("train.checkpoint_every", t.checkpoint_every, t.checkpoint_every >= 0, ">= 0 (0: at the end)"),
             ("train.eval_every", t.eval_every, t.eval_every >= 0, ">= 0 (0: at the end)"),
             ("train.snapshot_every", t.snapshot_every, t.snapshot_every >= 0, ">= 0 (0: none)"),
             ("train.watchdog_s", t.watchdog_s, 0 <= t.watchdog_s < math.inf, ">= 0 (0: off)")]
    m, muon = t.muon, " with train.optimizer=muon"
    if t.optimizer == "muon":
        rules += [("train.lr", t.lr, t.lr > 0, f"> 0{muon} (Muon's rate follows its schedule as a ratio)"),
                  ("train.muon.lr", m.lr, m.lr > 0, f"> 0{muon}"),
                  ("train.muon.momentum", m.momentum, 0 <= m.momentum < 1, f"in [0, 1){muon}, e.g. 0.95"),
                  ("train.muon.weight_decay", m.weight_decay, m.weight_decay >= 0, f">= 0{muon}"),
                  ("train.muon.ns_steps", m.ns_steps, 1 <= m.ns_steps < 100, f"in [1, 100){muon}, e.g. 5"),
                  ("train.muon.eps", m.eps, m.eps > 0, f"> 0{muon}, e.g. 1e-7")]
    for key, value, ok, need in rules:
        if not ok:  # NaN fails every rule
            raise ConfigError(f"{key}={value} must be {need}")
    check_compile(t)
    if t.snapshot_every and t.engine != "native":
        raise ConfigError(f"train.snapshot_every={t.snapshot_every} with train.engine={t.engine}: in-memory "
                          f"snapshots are not written for it yet; set train.snapshot_every=0 "
                          f"(disk checkpoints: train.checkpoint_every)")


def check_compile(t: TrainConfig) -> None:
    """train.compile_mode and train.compile_options: with train.compile, one of them, and
    options inductor has."""
    chosen = [f"train.compile_mode={t.compile_mode}"] if t.compile_mode != "default" else []
    chosen += [f"train.compile_options={t.compile_options}"] if t.compile_options else []
    if chosen and not t.compile:
        raise ConfigError(f"{chosen[0]} needs train.compile=true: without it nothing is compiled")
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)}: torch.compile takes a mode or options, not "
                          f"both; give the mode's settings as options (reduce-overhead is "
                          f"{{triton.cudagraphs: true}}: torch._inductor.list_mode_options())")
    if t.compile_options:
        import torch._inductor
        known = set(torch._inductor.list_options())
        unknown = sorted(set(inductor_options(t.compile_options)) - known)
        if unknown:
            raise ConfigError(f"train.compile_options: {', '.join(unknown)} is not an inductor "
                              f"setting of torch {torch.__version__}; "
                              f"torch._inductor.list_options() names them (e.g. "
                              f"coordinate_descent_tuning)")


def check_data(cfg: Config, world: int, data: PreparedData, sizes: list[int]) -> None:
    """The rules the data decides, once it is indexed (before any collective still): the layout
    again with the tokenizer's vocabulary (tp must split it padded), and one source must fill a
    global batch; in a blend each source must have a sample to give."""
    check_layout(cfg.model, cfg.parallel, world)
    least = cfg.train.global_batch_size if len(data.train) == 1 else 1
    for source, n in zip(data.train, sizes):
        if n < least:
            raise ConfigError(f"train.global_batch_size={cfg.train.global_batch_size} exceeds the "
                              f"{n} training samples of data path {source.name} "
                              f"(data.mode={cfg.data.mode}, data.seq_len={cfg.data.seq_len}): use "
                              f"a smaller global batch or more data"
                              + (" (data.synthetic_documents)" if source.name == "synthetic" else ""))


def with_pretrained(cfg: Config, given: frozenset[str]) -> Config:
    """train.init_from fixes the architecture, and its tokenizer unless one is given; the
    training settings among the model keys (config.TRAINING_SETTINGS) are the config's where
    `given` (run_config.given_keys) names them. A given architecture key must be the
    checkpoint's: replaced in silence, it would train another model than the config says."""
    if not cfg.train.init_from:
        return cfg
    source = Path(cfg.train.init_from)
    saved = pretrained_config(source)
    # vocab_size is never the config's to fix: the tokenizer's, or here the checkpoint's.
    named = sorted({key.split(".", 1)[1] for key in given if key.startswith("model.")}
                   - {"preset", "vocab_size"})
    ours, theirs = ({k: v for k, v, _ in leaves(m)} for m in (cfg.model, saved))
    differ = [f"model.{k}={ours.get(k)!r} (the checkpoint's: {theirs.get(k, 'absent')!r})"
              for k in named if (k not in TRAINING_SETTINGS or k not in theirs) and ours.get(k) != theirs.get(k)]
    if differ:
        raise ConfigError(f"train.init_from={source} fixes the architecture, and the config sets "
                          f"{', '.join(differ)}: drop " + ("these keys" if len(differ) > 1 else "the key")
                          + " (or give the checkpoint's value); of the model keys only "
                          f"{', '.join(TRAINING_SETTINGS)} are this run's to choose")
    model = saved
    for key in named:
        if key in TRAINING_SETTINGS:
            model = replaced(model, key, ours[key])
    data = cfg.data
    if data.tokenizer == "bpe" and (source / "tokenizer.json").is_file():
        data = dataclasses.replace(data, tokenizer=str(source / "tokenizer.json"))
    return dataclasses.replace(cfg, model=model, data=data)


def with_tokenizer_vocab(cfg: Config, data: PreparedData) -> Config:
    """model.vocab_size is the tokenizer's: the embedding must have a row for every token id.
    A pretrained model keeps its own vocabulary, which must hold the tokenizer's."""
    if cfg.train.init_from:
        check_tokenizer_matches(data.tokenizer, cfg.model, cfg.train.init_from)
        return cfg
    model = dataclasses.replace(cfg.model, vocab_size=data.tokenizer.vocab_size)
    return dataclasses.replace(cfg, model=model)


def with_epochs(cfg: Config, samples: int) -> Config:
    """train.epochs > 0: max_steps is that many passes over the `samples` training samples
    (a blend's sources together), rounded up to a whole step."""
    t = cfg.train
    if t.epochs == 0:
        return cfg
    if not 0 < t.epochs < math.inf:
        raise ConfigError(f"train.epochs={t.epochs} must be > 0 (passes over the training "
                          f"samples, which set train.max_steps), or 0 to use train.max_steps")
    steps = max(1, math.ceil(t.epochs * samples / t.global_batch_size))
    if t.warmup_steps >= steps:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} is not below the {steps} steps "
                          f"of train.epochs={t.epochs} ({samples} samples, train.global_batch_size="
                          f"{t.global_batch_size}): the learning rate would never leave warmup; "
                          f"lower train.warmup_steps")
    return dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=steps))


def with_schedule(cfg: Config, resume_from: Path | None) -> Config:
    """train.decay_steps=0 resolved: the first start's max_steps, which a checkpoint keeps."""
    if cfg.train.decay_steps:
        return cfg
    end = cfg.train.max_steps
    if resume_from is not None:
        saved = json.loads((resume_from / "meta.json").read_text())["config"]["train"]
        end = TrainConfig(max_steps=saved["max_steps"], decay_steps=saved.get("decay_steps", 0)).decay_end
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, decay_steps=end))


# What fixes the meaning of a step: change any of these and "resume" would train a different run.
RESUME_KEYS = ("model", "data", "train.global_batch_size", "run.seed")
SAME_DATA_KEYS = ("data.cache_dir", "data.workers")  # where and how fast, never what


def find_resume(cfg: Config, data: PreparedData) -> Path | None:
    """The checkpoint to resume from, or None; refuses to overwrite or to mix runs."""
    run_dir, resume = Path(cfg.run.dir), cfg.train.resume
    latest = latest_checkpoint(run_dir)
    if resume == "never":
        if latest is not None:
            raise ConfigError(f"run.dir '{run_dir}' already holds checkpoints (latest {latest.name}): "
                              f"train.resume=never would overwrite them; use train.resume=auto to "
                              f"continue, or a new run.dir")
        return None
    path = latest if resume == "auto" else Path(resume)
    if path is None:
        return None
    wrong = not_a_checkpoint(path)
    if wrong:
        raise ConfigError(f"train.resume: {wrong}; or train.resume=auto for run.dir's latest")
    saved = json.loads((path / "meta.json").read_text())
    if latest is not None and checkpoint_step(latest) > saved["step"]:
        raise ConfigError(f"run.dir '{run_dir}' holds {latest.name}, later than the step "
                          f"{saved['step']} of train.resume '{path}': resuming there would "
                          f"overwrite it; use another run.dir")
    # A key the checkpoint's version did not have had its default's meaning then; its model
    # may be of before the sections (flat_keys.py).
    model = to_dict(from_dict(ModelConfig, nest(saved["config"]["model"], note=False), "model."))
    now = _flat(to_dict(cfg))
    before = {**_flat(to_dict(Config())), **_flat({**saved["config"], "model": {}}), **_flat(model, "model.")}
    changed = [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(now)
               if k.startswith(RESUME_KEYS) and k not in SAME_DATA_KEYS and before.get(k) != now.get(k)]
    check_same_optimizer(cfg.train, saved["config"].get("train", {}), path)
    if saved.get("data_content", data.meta["content"]) != data.meta["content"]:
        changed.append("the tokenized data (corpus or tokenizer) differs")
    elif "data_content" not in saved and saved.get("data_cache_key") != data.meta["cache_key"] \
            and os.environ.get("RANK", "0") == "0":
        # Checkpoints before data_content named the data by its files' times only.
        print(f"data: {path} predates checking the data's content, and its data's files have "
              f"other times here (a copy or a clone): resuming on this data.path", file=sys.stderr)
    if changed:
        fix = (f"or a new run.dir (run.dir '{run_dir}' holds this checkpoint)" if resume == "auto" else
               f"or train.init_from={path} to start a new run from its weights")
        raise ConfigError(f"cannot resume from '{path}': " + "; ".join(changed) +
                          f". Resume with the saved values, {fix}")
    return path


def run_identity(cfg: Config, data: PreparedData) -> dict:
    """What fixes the meaning of a step (RESUME_KEYS) and the data: equal for the same run."""
    flat = _flat(to_dict(cfg))
    return {"config": {k: flat[k] for k in sorted(flat)
                       if k.startswith(RESUME_KEYS) and k not in SAME_DATA_KEYS},
            "data": data.meta["content"]}


def check_same_optimizer(t: TrainConfig, saved_train: dict, path: Path) -> None:
    """A checkpoint's optimizer state loads into the optimizer that wrote it only."""
    saved = saved_train.get("optimizer", "adamw")  # checkpoints before train.optimizer: AdamW's
    if t.load_optimizer and saved != t.optimizer:
        raise ConfigError(f"cannot resume from '{path}': it holds the state of train.optimizer={saved}, "
                          f"this run's is train.optimizer={t.optimizer}. Resume with "
                          f"train.optimizer={saved}, or set train.load_optimizer=false to load the "
                          f"weights alone ({t.optimizer} then starts from fresh state)")


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
