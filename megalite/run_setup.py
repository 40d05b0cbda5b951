"""The steps of a run's plan (plan.py, which alone calls them): the pretrained source's
architecture, the tokenizer's vocabulary, the steps of train.epochs, which checkpoint (if any) the
run resumes from and the schedule it keeps; and run.dir writable.

Each runs on every rank from the same files, so a bad run stops everywhere with the same
ConfigError and no rank is left waiting in a collective.
"""
import json
import math
import os
import sys
from pathlib import Path

from megalite.config import TRAINING_SETTINGS
from megalite.data.prepared import PreparedData
from megalite.hf.convert import check_tokenizer_matches, pretrained_config, saved_model_config
from megalite.run_config import Config, TrainConfig, flat, to_dict
from megalite.training.checkpoint_dirs import checkpoint_step, latest_checkpoint, not_a_checkpoint
from megalite.typed_config import ConfigError, leaves, replaced


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


def with_pretrained(cfg: Config, given: frozenset[str]) -> Config:
    """train.init_from fixes the architecture, and its tokenizer unless one is given; the
    training settings among the model keys (config.TRAINING_SETTINGS) are the config's where
    `given` (run_config.given_keys) names them. A given architecture key must be the
    checkpoint's: replaced in silence, it would train another model than the config says."""
    if not cfg.train.init_from:
        return cfg
    source = Path(cfg.train.init_from)
    model = pretrained_config(source)
    # vocab_size is never the config's to fix: the tokenizer's, or here the checkpoint's.
    named = sorted({key.split(".", 1)[1] for key in given if key.startswith("model.")}
                   - {"preset", "vocab_size"})
    ours, theirs = ({k: v for k, v, _ in leaves(m)} for m in (cfg.model, model))
    differ = [f"model.{k}={ours.get(k)!r} (the checkpoint's: {theirs.get(k, 'absent')!r})"
              for k in named if (k not in TRAINING_SETTINGS or k not in theirs) and ours.get(k) != theirs.get(k)]
    if differ:
        raise ConfigError(f"train.init_from={source} fixes the architecture, and the config sets "
                          f"{', '.join(differ)}: drop " + ("these keys" if len(differ) > 1 else "the key")
                          + " (or give the checkpoint's value); of the model keys only "
                          f"{', '.join(TRAINING_SETTINGS)} are this run's to choose")
    for key in set(named) & set(TRAINING_SETTINGS):
        model = replaced(model, key, ours[key])
    if cfg.data.tokenizer == "bpe" and (source / "tokenizer.json").is_file():
        cfg = replaced(cfg, "data.tokenizer", str(source / "tokenizer.json"))
    return replaced(cfg, "model", model)


def with_tokenizer_vocab(cfg: Config, data: PreparedData) -> Config:
    """model.vocab_size is the tokenizer's: the embedding must have a row for every token id.
    A pretrained model keeps its own vocabulary, which must hold the tokenizer's."""
    if cfg.train.init_from:
        check_tokenizer_matches(data.tokenizer, cfg.model, cfg.train.init_from)
        return cfg
    return replaced(cfg, "model.vocab_size", data.tokenizer.vocab_size)


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
    return replaced(cfg, "train.max_steps", steps)


def with_schedule(cfg: Config, resume_from: Path | None) -> Config:
    """train.decay_steps=0 resolved: the first start's max_steps, which a checkpoint keeps."""
    if cfg.train.decay_steps:
        return cfg
    meta = None if resume_from is None else json.loads((resume_from / "meta.json").read_text())
    saved = meta["config"]["train"] if meta else {"max_steps": cfg.train.max_steps}
    return replaced(cfg, "train.decay_steps", saved.get("decay_steps") or saved["max_steps"])


# What fixes the meaning of a step: change any of these and "resume" would train a different run.
RESUME_KEYS = ("model", "data", "train.global_batch_size", "run.seed")
SAME_DATA_KEYS = ("data.cache_dir", "data.workers")  # where and how fast, never what


def find_resume(cfg: Config, data: PreparedData) -> Path | None:
    """The checkpoint to resume from, or None; refuses to overwrite or to mix runs."""
    run_dir, resume = Path(cfg.run.dir), cfg.train.resume
    latest = latest_checkpoint(run_dir)
    if resume == "never" and latest is not None:
        raise ConfigError(f"run.dir '{run_dir}' already holds checkpoints (latest {latest.name}): "
                          f"train.resume=never would overwrite them; use train.resume=auto to "
                          f"continue, or a new run.dir")
    path = {"auto": latest, "never": None}.get(resume, Path(resume))
    if path is None:
        return None
    if wrong := not_a_checkpoint(path):
        raise ConfigError(f"train.resume: {wrong}; or train.resume=auto for run.dir's latest")
    saved = json.loads((path / "meta.json").read_text())
    if latest is not None and checkpoint_step(latest) > saved["step"]:
        raise ConfigError(f"run.dir '{run_dir}' holds {latest.name}, later than the step "
                          f"{saved['step']} of train.resume '{path}': resuming there would "
                          f"overwrite it; use another run.dir")
    # A key the checkpoint's version did not have had its default's meaning then; its model
    # may be of before the sections (flat_keys.py).
    model = to_dict(saved_model_config(saved))
    before = {**flat(to_dict(Config())), **flat({**saved["config"], "model": {}}), **flat(model, "model.")}
    changed = [f"{k}: {before.get(k)!r} -> {now!r}" for k, now in _step_settings(cfg).items()
               if before.get(k) != now]
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
    return {"config": _step_settings(cfg), "data": data.meta["content"]}


def _step_settings(cfg: Config) -> dict:
    """cfg's settings that fix the meaning of a step (RESUME_KEYS but SAME_DATA_KEYS), sorted."""
    return {k: v for k, v in sorted(flat(to_dict(cfg)).items())
            if k.startswith(RESUME_KEYS) and k not in SAME_DATA_KEYS}


def check_same_optimizer(t: TrainConfig, saved_train: dict, path: Path) -> None:
    """A checkpoint's optimizer state loads into the optimizer that wrote it only."""
    saved = saved_train.get("optimizer", "adamw")  # checkpoints before train.optimizer: AdamW's
    if t.load_optimizer and saved != t.optimizer:
        raise ConfigError(f"cannot resume from '{path}': it holds the state of train.optimizer={saved}, "
                          f"this run's is train.optimizer={t.optimizer}. Resume with "
                          f"train.optimizer={saved}, or set train.load_optimizer=false to load the "
                          f"weights alone ({t.optimizer} then starts from fresh state)")

