"""One plan per run: the config resolved against the world size, the prepared data and the
checkpoint to resume, once, before any process group exists (plan_run); and the rules every
entry point checks, gathered from the parts that own them into one error listing every problem,
each naming its key and the fix.

The rules live beside what they govern: the model's in its sections (config.py), the layout's
in layout_rules.py, FP8's in fp8/convert.py, DeepSpeed's in training/deepspeed_engine.py; the
training settings' here. Every rank checks the same files, so a bad run stops everywhere with the
same message and no rank waits in a collective.
"""
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

from megalite.config import ModelConfig, ParallelConfig
from megalite.data.batches import Mixture, Samples
from megalite.data.prepared import PreparedData, data_for_run
from megalite.fp8.convert import fp8_problems
from megalite.layout_rules import data_parallel_size, layout_problems
from megalite.parallel.context import context_chunks
from megalite.pipeline.objective import objective_of
from megalite.run_config import Config, TrainConfig
from megalite.run_setup import (check_run_dir, find_resume, with_epochs, with_pretrained,
                                with_schedule, with_tokenizer_vocab)
from megalite.training.build import inductor_options
from megalite.training.deepspeed_engine import deepspeed_problems
from megalite.typed_config import ConfigError, failing


@dataclass(frozen=True)
class Plan:
    """A run as it will train: `cfg` resolved (the pretrained architecture, the tokenizer's
    vocabulary, max_steps from train.epochs, the decay's end a checkpoint keeps), its data and
    samples, the checkpoint it resumes from."""
    cfg: Config
    data: PreparedData
    train_set: Mixture
    resume_from: Path | None


def plan_run(cfg: Config, given: frozenset[str], world: int, launched: bool = True) -> Plan:
    """`megalite train`'s plan: every rule, the data prepared (by its own process, where the
    cache lacks it: data_for_run) and read, the checkpoint found."""
    tokenizer_from = "train.init_from" if cfg.train.init_from and cfg.data.tokenizer == "bpe" \
        else "data.tokenizer"  # the tokenizer a pretrained model brings, unless one is given
    cfg = with_pretrained(cfg, given)
    validate(cfg, world, launched=launched, vocab_from_tokenizer=not cfg.train.init_from)
    check_run_dir(Path(cfg.run.dir))
    data = data_for_run(cfg.data, tokenizer_from=tokenizer_from)
    cfg = with_tokenizer_vocab(cfg, data)
    train_set = sample_sets(data.train, cfg, data)
    raise_problems(layout_problems(cfg.model, cfg.parallel, world) + data_problems(cfg, data, train_set.sizes))
    cfg = with_epochs(cfg, sum(train_set.sizes))
    resume_from = find_resume(cfg, data)
    return Plan(with_schedule(cfg, resume_from), data, train_set, resume_from)


def plan_config(cfg: Config, given: frozenset[str], world: int) -> Config:
    """A run planned elsewhere (a sweep's point on a login node): the config its job will
    resolve, checked but for its data and the packages its nodes will have."""
    cfg = with_pretrained(cfg, given)
    validate(cfg, world, installed=False)
    return cfg


def check_layout(model: ModelConfig, parallel: ParallelConfig, world: int) -> None:
    """A model on a layout (a checkpoint's run forward: generate, eval): layout_problems'."""
    raise_problems(layout_problems(model, parallel, world))


def validate(cfg: Config, world: int, launched: bool = True, installed: bool = True,
              vocab_from_tokenizer: bool = False) -> None:
    """Every rule a run's config must meet on `world` processes (launched: under torchrun or
    Slurm, with a process group to come), before it reads data or joins a collective.
    installed: also that the packages it needs are installed here (false where the run happens
    elsewhere). vocab_from_tokenizer: model.vocab_size will be the tokenizer's, so its split over
    tp waits for the data."""
    parallel, t = cfg.parallel, cfg.train
    dp = data_parallel_size(parallel, world)  # if that does not divide, the layout's rules say so
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp) if t.micro_batch_size > 0 else None
    raise_problems(layout_problems(cfg.model, parallel, world, micro_batches, vocab=not vocab_from_tokenizer)
                   + run_problems(cfg, world, dp, installed) + train_problems(t)
                   + fp8_problems(cfg) + deepspeed_problems(t, cfg.model, parallel,
                                                            world if launched else None, installed))


def raise_problems(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def run_problems(cfg: Config, world: int, dp: int, installed: bool) -> list[str]:
    """The batch arithmetic, rows against the model and CP's chunks, the engine's stage."""
    parallel, t, seq = cfg.parallel, cfg.train, cfg.data.seq_len
    split = (f"tp {parallel.tp}" if parallel.pp == parallel.cp == 1 else
             f"(tp x cp x pp) {parallel.tp * parallel.cp * parallel.pp}")
    chunks = context_chunks(parallel.cp, parallel.tp, parallel.sequence_parallel)
    sp = " x parallel.tp (sequence parallel)" if parallel.sequence_parallel else ""
    batches = t.micro_batch_size >= 1 and t.global_batch_size >= 1
    return failing(
        (parallel.dp_bucket_mb > 0, f"parallel.dp_bucket_mb={parallel.dp_bucket_mb} must be > 0: it is the "
                                    f"size of a DP gradient bucket in MiB; use e.g. 25 (PyTorch DDP's default)"),
        (not (t.engine == "native" and t.zero_stage == 2),
         "train.zero_stage=2 with train.engine=native: the native engine partitions the optimizer "
         "state (stage 1), not the gradients; use train.zero_stage=1, or train.engine=deepspeed for stage 2"),
        (not (parallel.ep > 1 and t.engine == "deepspeed"),
         f"parallel.ep={parallel.ep} with train.engine=deepspeed: DeepSpeed's ZeRO would sum the experts' "
         f"gradients over every DP rank, not the ranks holding the same experts; use "
         f"train.engine=native (train.zero_stage 0 or 1)"),
        (batches, f"train.global_batch_size={t.global_batch_size} and train.micro_batch_size="
                  f"{t.micro_batch_size} must be >= 1"),
        (not batches or t.global_batch_size % (t.micro_batch_size * dp) == 0,
         f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
         f"{t.micro_batch_size} x DP={dp} (world {world} / {split}): use a global batch that is a "
         f"multiple of {t.micro_batch_size * dp}, so every DP rank runs whole micro-batches"),
        (seq >= 1, f"data.seq_len={seq} must be >= 1: the tokens of a training row"),
        (seq <= cfg.model.max_seq_len, f"data.seq_len={seq} exceeds model.max_seq_len="
                                       f"{cfg.model.max_seq_len}: lower data.seq_len or raise max_seq_len"),
        (seq < 1 or seq % chunks == 0,
         f"data.seq_len={seq} with parallel.cp={parallel.cp}: each row is cut into 2 x parallel.cp{sp} = "
         f"{chunks} equal chunks, so data.seq_len must be a multiple of {chunks}: use "
         f"data.seq_len={seq + chunks - seq % chunks}"),
        (not (installed and cfg.run.wandb) or importlib.util.find_spec("wandb") is not None,
         "run.wandb=true needs the wandb package: pip install 'megalite[wandb]', or set run.wandb=false"),
        (not (installed and t.fp8.recipe != "none") or importlib.util.find_spec("torchao") is not None,
         f"train.fp8.recipe={t.fp8.recipe} needs the torchao package: pip install 'torchao>=0.18', "
         f"or set train.fp8.recipe=none"),
    )


# The train.<key> numbers that must be >= 0, and what 0 means (empty: nothing of its own)
AT_LEAST_ZERO = {"eval_tokens": "the whole held-out set", "decay_steps": "train.max_steps", "lr": "",
                 "min_lr": "", "warmup_steps": "no warmup", "epochs": "train.max_steps", "weight_decay": "",
                 "grad_clip": "no clipping", "checkpoint_every": "at the end", "eval_every": "at the end",
                 "snapshot_every": "none", "watchdog_s": "off"}


def train_problems(t: TrainConfig) -> list[str]:
    """The numbers an optimizer or schedule would take in a form of its own (torch reports a
    bad lr as the scheduled value, not the one typed), each named with the value given; what
    compiling and snapshots take."""
    rules = [(f"train.{key}", getattr(t, key), getattr(t, key) >= 1, ">= 1")
             for key in ("max_steps", "keep_checkpoints", "log_every", "loss_chunk_tokens")]
    for key, zero in AT_LEAST_ZERO.items():
        value, note = getattr(t, key), f" (0: {zero})" if zero else ""
        finite = value < math.inf or key not in ("epochs", "watchdog_s")  # math.inf passes >= 0
        rules.append((f"train.{key}", value, value >= 0 and finite, f">= 0{note}"))
    rules += [(f"train.{key}", getattr(t, key), 0 <= getattr(t, key) < 1, f"in [0, 1), e.g. {example}")
              for key, example in (("beta1", 0.9), ("beta2", 0.95))]
    m, muon = t.muon, " with train.optimizer=muon"
    if t.optimizer == "muon":
        rules += [("train.lr", t.lr, t.lr > 0, f"> 0{muon} (Muon's rate follows its schedule as a ratio)"),
                  ("train.muon.lr", m.lr, m.lr > 0, f"> 0{muon}"),
                  ("train.muon.momentum", m.momentum, 0 <= m.momentum < 1, f"in [0, 1){muon}, e.g. 0.95"),
                  ("train.muon.weight_decay", m.weight_decay, m.weight_decay >= 0, f">= 0{muon}"),
                  ("train.muon.ns_steps", m.ns_steps, 1 <= m.ns_steps < 100, f"in [1, 100){muon}, e.g. 5"),
                  ("train.muon.eps", m.eps, m.eps > 0, f"> 0{muon}, e.g. 1e-7")]
    a, ada = t.adafactor, " with train.optimizer=adafactor"
    if t.optimizer == "adafactor":  # torch.optim.Adafactor's own bounds
        rules += [("train.lr", t.lr, t.lr > 0, f"> 0{ada} (Adafactor's rate follows its schedule as a ratio)"),
                  ("train.adafactor.lr", a.lr, a.lr > 0, f"> 0{ada}, e.g. 1e-2"),
                  ("train.adafactor.beta2_decay", a.beta2_decay, a.beta2_decay <= 0, f"<= 0{ada}, e.g. -0.8"),
                  ("train.adafactor.eps1", a.eps1, a.eps1 is None or a.eps1 >= 0, f"null or >= 0{ada}"),
                  ("train.adafactor.eps2", a.eps2, a.eps2 >= 0, f">= 0{ada}, e.g. 1e-3"),
                  ("train.adafactor.d", a.d, a.d >= 1, f">= 1{ada}, e.g. 1.0"),
                  ("train.adafactor.weight_decay", a.weight_decay, a.weight_decay >= 0, f">= 0{ada}")]
    problems = [f"{key}={value} must be {need}" for key, value, ok, need in rules if not ok]  # NaN fails all
    p = t.profile_steps
    if p is not None and not 1 <= p[0] <= p[1] <= t.max_steps:
        problems.append(f"train.profile_steps={list(p)} must be [first, last] optimizer steps with "
                        f"1 <= first <= last <= train.max_steps={t.max_steps}")
    if t.snapshot_every and t.engine != "native":
        problems.append(f"train.snapshot_every={t.snapshot_every} with train.engine={t.engine}: in-memory "
                        f"snapshots are not written for it yet; set train.snapshot_every=0 "
                        f"(disk checkpoints: train.checkpoint_every)")
    return problems + objective_problems(t) + compile_problems(t)


def objective_problems(t: TrainConfig) -> list[str]:
    """train.objective is one, and each micro-batch holds whole groups of its rows."""
    try:
        rows = objective_of(t.objective).group_rows
    except ValueError as e:
        return [str(e)]
    return failing((t.micro_batch_size % rows == 0,
                    f"train.micro_batch_size={t.micro_batch_size} with train.objective={t.objective}: its "
                    f"rows come in groups of {rows}, which a micro-batch keeps together; use a multiple of {rows}"))


def compile_problems(t: TrainConfig) -> list[str]:
    """train.compile_mode and train.compile_options: with train.compile, one of them, and
    options inductor has."""
    chosen = [f"train.compile_mode={t.compile_mode}"] if t.compile_mode != "default" else []
    chosen += [f"train.compile_options={t.compile_options}"] if t.compile_options else []
    if chosen and not t.compile:
        return [f"{chosen[0]} needs train.compile=true: without it nothing is compiled"]
    if len(chosen) > 1:
        return [f"{' and '.join(chosen)}: torch.compile takes a mode or options, not both; give the "
                f"mode's settings as options (reduce-overhead is {{triton.cudagraphs: true}}: "
                f"torch._inductor.list_mode_options())"]
    if t.compile_options:
        import torch._inductor
        if unknown := sorted(set(inductor_options(t.compile_options)) - set(torch._inductor.list_options())):
            return [f"train.compile_options: {', '.join(unknown)} is not an inductor setting of "
                    f"torch {torch.__version__}; torch._inductor.list_options() names them (e.g. "
                    f"coordinate_descent_tuning)"]
    return []


def data_problems(cfg: Config, data: PreparedData, sizes: list[int]) -> list[str]:
    """What the data decides once indexed: one source must fill a global batch; in a blend
    each source must have a sample to give."""
    least = cfg.train.global_batch_size if len(data.train) == 1 else 1
    return [f"train.global_batch_size={cfg.train.global_batch_size} exceeds the {n} training samples "
            f"of data path {source.name} (data.mode={cfg.data.mode}, data.seq_len={cfg.data.seq_len}): "
            f"use a smaller global batch or more data"
            + (" (data.synthetic_documents)" if source.name == "synthetic" else "")
            for source, n in zip(data.train, sizes) if n < least]


def sample_sets(sources, cfg: Config, data: PreparedData) -> Mixture:
    # Padded rows widen to whole chunks.
    chunks = context_chunks(cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel)
    return Mixture([Samples(s.docs, cfg.data.mode, cfg.data.seq_len, data.tokenizer.pad_id, chunks)
                    for s in sources], [s.weight for s in sources])
