"""Throughput, MFU (PaLM, Chowdhery et al. 2022, appendix B), metrics.jsonl and the loss plot."""
import json
import resource
from pathlib import Path

import torch

from megalite.config import ModelConfig
from megalite.parallel.mappings import all_reduce_over
from megalite.parallel.state import ParallelState

# Dense bf16 peak FLOP/s per device, by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def matmul_params(cfg: ModelConfig) -> int:
    """N of the PaLM formula: every weight used in a matmul, the LM head once even if tied;
    embedding and position lookups excluded. MoE layers count what a token uses: the router,
    its top-k experts and the shared ones."""
    per_width = (3 if cfg.gated else 2) * cfg.hidden
    moe = cfg.moe and (cfg.hidden * cfg.n_experts + per_width * (cfg.moe.top_k * cfg.expert_ffn + cfg.shared_ffn)
                       + cfg.hidden * cfg.moe.shared_gate)
    mlps = sum(moe if cfg.is_moe_layer(i) else per_width * cfg.ffn for i in range(cfg.n_layers))
    return cfg.n_layers * attention_params(cfg) + mlps + cfg.vocab_size * cfg.hidden


def attention_params(cfg: ModelConfig) -> int:
    """One layer's attention matrices: Q, K, V and O; MLA's down- and up-projections."""
    if cfg.mla:
        heads, rank = cfg.n_heads, cfg.attention.kv_lora_rank
        q_width = heads * cfg.qk_width
        q = cfg.hidden * q_width if cfg.attention.q_lora_rank is None else cfg.attention.q_lora_rank * (cfg.hidden + q_width)
        kv = cfg.hidden * (rank + cfg.attention.qk_rope_head_dim) + rank * heads * (cfg.attention.qk_nope_head_dim + cfg.attention.v_head_dim)
        return q + kv + heads * cfg.attention.v_head_dim * cfg.hidden
    return cfg.hidden * cfg.n_heads * cfg.head_size * 2 + cfg.hidden * 2 * cfg.kv_heads * cfg.head_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 N (forward and backward of the matmuls) + 12 L h s (attention scores and values), h
    the heads' total width (n_heads x head_dim; MLA: the mean of its q/k and v widths) and s
    what a query sees: the sequence, or a sliding layer's window where shorter."""
    widths = cfg.n_heads * (cfg.qk_width + cfg.v_width)
    seen = sum(min(seq_len, cfg.window_of(i) or seq_len) for i in range(cfg.n_layers))
    return 6 * matmul_params(cfg) + 6 * widths * seen


def peak_memory_bytes(ps: ParallelState) -> float:
    """The fullest rank's peak memory (a collective over all ranks): on CUDA the most allocated
    since the last call (the counter is then reset); on CPU the process's peak resident set,
    since it started."""
    if ps.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ps.device)
        torch.cuda.reset_peak_memory_stats(ps.device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return ps.reduce_over_ranks(peak)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None (CPU, or a GPU not in the table): MFU left blank."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, in order; none if it does not exist yet."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


class MetricsLog:
    """RUN_DIR/metrics.jsonl, one JSON object per line, appended (a resumed run continues it),
    and the same records to wandb when a wandb run is given."""

    def __init__(self, path: Path, resume_after_step: int | None, wandb_run=None):
        self.path, self.wandb_run = path, wandb_run
        if resume_after_step is None:
            path.write_text("")
        elif path.exists():
            # Drop records of steps the resumed run will redo (written after the checkpoint).
            kept = [r for r in read_records(path) if r.get("step", 0) <= resume_after_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None},
                               step=record["step"])


def start_wandb(project: str, run_dir: Path, config: dict):
    """A wandb run, offline unless an API key is set (no network is assumed)."""
    import os

    import wandb  # presence checked with the config, before any collective
    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wandb.init(project=project, dir=str(run_dir), config=config, mode=mode)


def plot_losses(metrics: Path, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(metrics)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, style, label in (("loss", "-", "train loss"), ("val_loss", "o-", "validation loss")):
        if points := [(r["step"], r[key]) for r in records if key in r]:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def moe_metrics(model, pstate: ParallelState, steps: int) -> dict:
    """The MoE layers' statistics over the `steps` training steps since the last call, all
    ranks together (a collective over DP, CP, TP and PP; empty for a dense model), then reset:
    moe_aux_loss, the balancing losses added to the loss (per step); moe_dropped, copies over
    capacity; moe_load, copies routed to each expert, per MoE layer."""
    layers = [i for i in range(model.cfg.n_layers) if model.cfg.is_moe_layer(i)]
    if not layers:
        return {}
    load = torch.zeros(len(layers), model.cfg.n_experts, dtype=torch.long, device=pstate.device)
    parts = torch.zeros(2, dtype=torch.float64, device=pstate.device)  # aux loss, dropped
    for row, layer in enumerate(layers):
        if str(layer) in model.blocks:
            moe = model.blocks[layer].mlp
            load[row] = moe.load
            parts += torch.stack([moe.aux_loss.double(), moe.dropped.double()])
            moe.reset_statistics()
    # load: whole micro-batches' counts, once per DP rank; parts: each rank's own tokens' share.
    all_reduce_over(load, pstate.dp_group, pstate.pp_group)
    all_reduce_over(parts, pstate.grad_group, pstate.pp_group,
                    model.tp.group if model.tp.sequence_parallel else None)
    return {"moe_aux_loss": parts[0].item() / steps, "moe_dropped": int(parts[1].item()),
            "moe_load": load.tolist()}
