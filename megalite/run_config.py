"""The whole run's config: model, parallel layout, data, training, run directory, sampling.

    cfg = load_config("configs/demo.yaml", ["parallel.tp=2", "train.max_steps=8"])

Dotted overrides are parsed as YAML values and type-checked like the file; an unknown key is an
error naming the nearest valid one. `model` is a preset name, or a mapping whose optional
`preset` key names the preset its other keys override.
"""
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional

import yaml

from megalite.config import PRESET_DIR, ModelConfig, ParallelConfig
from megalite.flat_keys import nest
from megalite.typed_config import ConfigError, from_dict, merged, set_dotted


@dataclass(frozen=True)
class DataConfig:
    # "embedded" (the Python documentation prose shipped with megalite); raw files (.jsonl,
    # .jsonl.gz, .jsonl.zst, .parquet, .txt), a directory or a glob of them, prepared into
    # cache_dir on first use; a directory from `megalite prepare-data`; a Megatron-LM .bin/.idx
    # prefix; a glob of prepared directories or prefixes; or "synthetic" (random token ids, as
    # Megatron's --mock-data: throughput without data).
    path: str = "embedded"
    # [[weight, path], ...] (Megatron's --data-path 0.7 A 0.3 B): each step's samples come from
    # the paths in proportion to the weights. Replaces `path` when given.
    blend: list = field(default_factory=list)
    # Validation documents from this path; empty: val_fraction of each source's documents.
    val_path: str = ""
    # "bpe": a byte-level BPE trained on the first bpe_sample_mb of the documents and cached;
    # else a tokenizer.json or a Hugging Face tokenizer directory (required with Megatron data,
    # which does not name its tokenizer). No pad token needed: eos fills padding where it has none.
    tokenizer: str = "bpe"
    # The token that ends a document (of data.tokenizer), where the tokenizer's files do not
    # name one and it holds none, or several, of the end-of-document names megalite knows.
    eos_token: Optional[str] = None
    bpe_vocab_size: int = 4096  # tokenizer=bpe: its vocabulary size
    bpe_sample_mb: float = 100.0  # tokenizer=bpe: MB of the documents it is trained on
    text_key: str = "text"  # the JSON field / parquet column holding a document
    strict: bool = False  # a record that is not JSON or lacks text_key: an error, not counted
    # Conversations instead of documents: jsonl records of `messages` (a list of {role,
    # content}) or of `prompt` and `completion`, rendered with this chat template (auto: the
    # tokenizer directory's own; or the template, or a .jinja file); none: documents.
    chat_template: Optional[str] = None
    train_on: Literal["assistant", "last", "all"] = "assistant"  # which tokens of a conversation are targets
    workers: int = 0  # tokenizing processes when raw files are prepared (0: in the rank itself)
    seq_len: int = 128  # tokens per training row
    # Documents longer than a row (seq_len + 1 tokens: a conversation, say) left out, where
    # they would be truncated (padded) or run on into the next row (packed); counted at start.
    drop_longer: bool = False
    # padded: a document per row; packed: documents joined, no attention across
    mode: Literal["padded", "packed"] = "packed"
    val_fraction: float = 0.02  # held-out share of each source's documents (without val_path)
    # path=synthetic: documents of uniformly random token ids of data.tokenizer (bpe: megalite's
    # BPE of the embedded corpus), of 2 to 2 x seq_len tokens, the same on every rank
    synthetic_documents: int = 4096
    # where raw files are prepared into shards, keyed by files and settings
    cache_dir: str = ".megalite_cache"


@dataclass(frozen=True)
class MuonConfig:
    """train.optimizer=muon: Newton-Schulz orthogonalised momentum for the blocks' matrices,
    torch.optim.Muon's settings; embeddings, the LM head, norms and biases take AdamW."""
    lr: float = 0.02  # Muon's peak learning rate; the schedule scales it as it scales train.lr
    momentum: float = 0.95  # the momentum buffer's decay: buf = momentum x buf + (1 - momentum) x grad
    nesterov: bool = True  # orthogonalise grad + momentum x (buf - grad), not buf
    weight_decay: float = 0.1  # decoupled, as AdamW's: w -= lr x weight_decay x w
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)  # the quintic's a, b, c
    eps: float = 1e-7  # floor of the norm the update is divided by before the iterations
    # The update's scale per matrix of shape A x B: original (Keller Jordan's), sqrt(max(1,
    # A / B)); match_rms_adamw (Moonlight's), 0.2 x sqrt(max(A, B)), with which Muon can take
    # AdamW's learning rate and weight decay; none: 1.
    adjust_lr: Literal["original", "match_rms_adamw", "none"] = "original"
    # The iterations' dtype: bf16 as torch.optim.Muon; fp32 costs more and is what the layout
    # exactness tests use (bf16 rounds the layouts' last-bit differences apart).
    ns_dtype: Literal["bf16", "fp32"] = "bf16"


@dataclass(frozen=True)
class AdafactorConfig:
    """train.optimizer=adafactor: torch.optim.Adafactor for every matrix (its defaults), each
    logical matrix stepped whole; biases and norm weights take AdamW."""
    lr: float = 1e-2  # the cap of its relative step size min(lr, 1 / sqrt(step)), scaled by the schedule
    beta2_decay: float = -0.8  # the second moments' rate at step t: t ** beta2_decay
    eps1: Optional[float] = None  # floor of the row factors' mean (None: the dtype's eps)
    eps2: float = 1e-3  # floor of the weight's RMS the step is scaled by
    d: float = 1.0  # the update's RMS is clipped to d (>= 1)
    weight_decay: float = 0.0  # decoupled: w -= lr x weight_decay x w


@dataclass(frozen=True)
class Fp8Config:
    """train.fp8: the blocks' matmuls in FP8 with torchao's float8 training (docs/fp8.md)."""
    # none; tensorwise (one scale per tensor), rowwise (per row of each matmul operand, scales
    # rounded to powers of 2), rowwise_with_gw_hp (rowwise, weight gradients in high precision):
    # torchao's Float8LinearRecipeName.
    recipe: Literal["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "none"
    # auto: torchao's size filter for the recipe (layers too small to gain stay in high
    # precision), asked about each layer's whole shape; all: every block linear and expert.
    layers: Literal["auto", "all"] = "auto"
    exclude: tuple[str, ...] = ()  # parameter-name parts kept in high precision, e.g. [out_proj]
    emulate: bool = False  # cast to FP8, multiply in fp32 (torchao's emulate): GPUs without FP8


@dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int = 16  # sequences per optimizer step, all DP ranks together
    micro_batch_size: int = 4  # sequences per forward/backward on one DP rank
    max_steps: int = 100  # optimizer steps
    # > 0: passes over the training samples, which set max_steps (rounded up to whole steps:
    # epochs x samples / global_batch_size), as fine-tuning on a small set counts them
    epochs: float = 0.0
    lr: float = 1e-3  # peak learning rate, reached after warmup
    min_lr: float = 1e-4  # the cosine decay's floor, from decay_steps on
    warmup_steps: int = 10  # linear warmup steps
    # The step the cosine decay reaches min_lr. 0: the max_steps the run first started with,
    # kept by a resume that raises max_steps (the extra steps train at min_lr); set it to the
    # new max_steps to stretch the decay instead.
    decay_steps: int = 0
    # adamw; or muon: Muon for the blocks' matrices (train.muon), AdamW (train.lr, beta1,
    # beta2, weight_decay) for the rest; or adafactor: Adafactor for every matrix
    # (train.adafactor), AdamW for the rest (engine=native only). docs/optimizers.md says which when.
    optimizer: Literal["adamw", "muon", "adafactor"] = "adamw"
    muon: MuonConfig = field(default_factory=MuonConfig)
    adafactor: AdafactorConfig = field(default_factory=AdafactorConfig)
    # Resuming, load the checkpoint's optimizer state (false: its weights and step only, the
    # optimizer starting fresh: the way to resume with another train.optimizer).
    load_optimizer: bool = True
    fp8: Fp8Config = field(default_factory=Fp8Config)
    weight_decay: float = 0.1  # AdamW's decay, on matrices only (not biases or norms)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    grad_clip: float = 1.0  # global gradient norm; 0 disables clipping
    # auto: bf16 autocast on GPU, fp32 on CPU. bf16: autocast over fp32 weights. pure_bf16
    # (engine=native): bf16 weights and activations, fp32 masters, Adam and gradient sums.
    precision: Literal["auto", "fp32", "bf16", "pure_bf16"] = "auto"
    activation_checkpointing: bool = False  # recompute each block in backward instead of storing it
    # Tokens per chunk of the fused LM head + loss, which holds chunk x padded_vocab / tp fp32
    # logits at a time (and never the whole batch's): lower it if memory is tight.
    loss_chunk_tokens: int = 4096
    # What a step minimises (pipeline/objective.py): lm, next-token cross-entropy over the global
    # batch's target tokens; or a class by import path, package.module:Name (eval stays lm's)
    objective: str = "lm"
    compile: bool = False  # torch.compile the whole model, embedding to loss (the first steps compile)
    # train.compile's torch.compile mode: reduce-overhead replays the compiled step as CUDA
    # graphs (less launch time where a GPU's work per step is small); max-autotune also tunes
    # the kernels (minutes more compiling). docs/benchmarks.md#compile-settings
    compile_mode: Literal["default", "reduce-overhead", "max-autotune",
                          "max-autotune-no-cudagraphs"] = "default"
    # Inductor settings instead of a mode (torch._inductor.list_options()), e.g.
    # {coordinate_descent_tuning: true}; nested keys join with dots ({triton: {cudagraphs: true}}).
    compile_options: dict = field(default_factory=dict)
    checkpoint_every: int = 0  # steps; 0: only at the end
    # Steps between in-memory snapshots (0: none): each rank's state in the node's shared
    # memory, from which a run restarted by its launcher after a rank died goes on
    # (train.resume=auto; same layout only). docs/training.md#snapshots
    snapshot_every: int = 0
    # Where they go, a directory of each node's own (its memory); empty: the node's shared
    # memory, /dev/shm/megalite-snapshots/<a hash of run.dir>
    snapshot_dir: str = ""
    # Seconds a rank may go without finishing a step (after the first) before the run counts as
    # hung: the ranks behind are killed where they share a node, and the rank exits so that the
    # launcher restarts the ranks; above the longest step, evaluation and save. 0: off.
    watchdog_s: float = 0.0
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    resume: str = "auto"  # auto | never | a checkpoint directory
    # Start from these weights (a megalite checkpoint or a Hugging Face directory) instead of a
    # random init: its architecture replaces `model` (but for dropout) and, with
    # data.tokenizer=bpe, its tokenizer.json is used.
    init_from: str = ""
    eval_every: int = 0  # steps; 0: only at the end
    # Validation tokens per evaluation: the first ceil(N / data.seq_len) held-out samples (a
    # fixed set, so evaluations compare; its size is printed at start); 0: the whole held-out
    # set, which on a large corpus costs as much as many training steps.
    eval_tokens: int = 1 << 20
    log_every: int = 1  # steps between metrics records (each waits for the device)
    # [first, last]: trace these optimizer steps (1-based) with torch.profiler; each rank writes
    # run.dir/profile/steps{A}-{B}_rank{R}.json (chrome://tracing, ui.perfetto.dev). None: off.
    profile_steps: Optional[tuple[int, int]] = None
    # Data-parallel engine: megalite's own, or DeepSpeed ZeRO (pip install 'megalite[deepspeed]').
    engine: Literal["native", "deepspeed"] = "native"
    # 0: every replica (CP x DP) holds all of Adam's state (and pure_bf16's fp32 masters). 1: each
    # holds its share: engine=native's distributed optimizer (gradients reduce-scattered, weights
    # all-gathered), or DeepSpeed ZeRO-1. 2 (engine=deepspeed only): gradients partitioned too.
    zero_stage: Literal[0, 1, 2] = 1
    # engine=deepspeed: more DeepSpeed config keys (e.g. zero_optimization.reduce_bucket_size),
    # merged into the config megalite derives from this section.
    deepspeed: dict = field(default_factory=dict)

    @property
    def decay_end(self) -> int:
        return self.decay_steps or self.max_steps


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"  # the run's directory: config, metrics, checkpoints, plots, samples
    seed: int = 1234  # init, data order and dropout: the same run at any layout
    wandb: bool = False  # also log to Weights & Biases (pip install 'megalite[wandb]')
    wandb_project: str = "megalite"  # the Weights & Biases project


@dataclass(frozen=True)
class SampleConfig:
    # sampled from at the end of training (samples.txt)
    prompts: list[str] = field(default_factory=lambda: ["The", "A list is"])
    max_new_tokens: int = 48  # tokens generated per prompt
    temperature: float = 0.8  # sampling temperature (0: greedy)
    top_k: int = 40  # sample among the k likeliest tokens (0: all)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)


def load_config(path: str | Path | None, overrides: list[str] = (), pretrained=None) -> Config:
    """pretrained: the model mapping of a train.init_from path (hf.convert.pretrained_model),
    the base its model keys go on: a key of the checkpoint's variants (model.mlp.aux_loss_coeff
    of a mixture of experts) reads as the config's of that model."""
    raw = _raw_config(path, overrides)
    train = raw["train"] if isinstance(raw.get("train"), dict) else {}
    # A key of earlier versions, which a run's config.yaml may hold (a Slurm task re-reads its
    # own on requeue): dropped with a note, so that such a config still loads.
    if "eval_batches" in train:
        del train["eval_batches"]
        warnings.warn("config key train.eval_batches is retired and ignored: see train.eval_tokens "
                      "(0: the whole held-out set)", stacklevel=2)
    if train.get("init_from") and pretrained is not None:
        raw["model"] = merged(pretrained(train["init_from"]), raw["model"], ModelConfig)
    return from_dict(Config, raw)


def given_keys(path: str | Path | None, overrides: list[str] = ()) -> frozenset[str]:
    """The dotted keys the file, its model preset and the overrides set, whatever their value
    (what train.init_from must not replace in silence)."""
    return frozenset(flat(_raw_config(path, overrides)))


def _raw_config(path: str | Path | None, overrides: list[str]) -> dict:
    raw = {} if path is None else _read_yaml(Path(path), f"config file '{path}' not found")
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{override}' is not of the form key.sub=value")
        set_dotted(raw, key.strip().split("."), yaml.safe_load(value))
    raw["model"] = _resolve_preset(raw.get("model", {}))
    return raw


def _read_yaml(path: Path, missing: str) -> dict:
    if not path.is_file():
        raise ConfigError(missing)
    return yaml.safe_load(path.read_text()) or {}


def read_preset(name: str) -> dict:
    """The raw mapping of a model preset under megalite/presets/ (e.g. 'gpt2-small')."""
    presets = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
    return _read_yaml(PRESET_DIR / f"{name}.yaml", f"model config '{name}' not found (presets: {presets})")


def flat(tree, prefix: str = "") -> dict:
    """{dotted key: value} of a mapping's settings; an empty mapping is a value of its own."""
    out = {}
    for key, value in tree.items() if isinstance(tree, dict) else ():
        # A mapping-valued key that is a setting of its own (train.compile_options) still
        # yields its sub-keys: a prefix match on the section is what callers ask.
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def to_dict(cfg: Config) -> dict:
    """As a checkpoint's meta.json holds it: tuples are lists there, so compare like with like."""
    return json.loads(json.dumps(asdict(cfg)))


def _resolve_preset(model) -> dict:
    if isinstance(model, str):
        model = {"preset": model}
    if not isinstance(model, dict):
        return model
    model = nest(model)
    return merged(read_preset(model.pop("preset")), model, ModelConfig) if "preset" in model else model


def load_model_config(name_or_path: str | Path, **overrides) -> ModelConfig:
    """A preset name from megalite/presets/ or a path to a YAML file, with keyword overrides."""
    path = Path(name_or_path)
    is_file = path.suffix in (".yaml", ".yml") or path.is_file()  # a preset: qwen3-0.6b
    data = (_read_yaml(path, f"model config file '{path}' not found") if is_file
            else read_preset(str(name_or_path)))
    return from_dict(ModelConfig, merged(nest(data), overrides, ModelConfig), "model.")
