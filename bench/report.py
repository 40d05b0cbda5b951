"""A bench sweep's results: results.csv, results.json and the plots.

scaling.png   tokens/s against devices, one line per setting of everything but dp, with the
              ideal (linear from the line's first point) dashed
mfu.png       MFU per point (achieved TFLOP/s per device where the device has no peak in the
              table, as on CPU)
memory.png    peak memory per point (CUDA max allocated in the timed steps; on CPU the
              process's peak RSS over the whole run)
step.png      the step split into compute and communication (the instrumented step)
"""
from __future__ import annotations

import csv
import datetime
import json
from pathlib import Path

import torch

from bench.provenance import git_commit
from megalite.launch.sweep import setting_name

COLUMNS = ["point", "status", "device", "tp", "cp", "cp_comm", "pp", "dp", "devices", "sequence_parallel",
           "pp_schedule", "virtual_stages", "pipeline_bubble", "pipeline_bubble_measured",
           "pipeline_wait_s", "engine",
           "activation_checkpointing", "compile", "batch", "precision", "fp8", "fp8_layers",
           "micro_batch_size",
           "global_batch_size", "seq_len", "layers", "hidden", "step_s", "tokens_per_s",
           "tokens_per_s_per_device", "tflops_per_device", "mfu", "peak_memory_gb", "memory_kind",
           "comm_s", "compute_s", "comm_bytes", "comm_wire_bytes", "activation_bytes_per_layer",
           "activation_formula_bytes_per_layer", "head_loss_saved_bytes", "head_loss_peak_bytes"]


def flat_row(row: dict) -> dict:
    """One CSV row: the fixed columns, the point's own settings, and `bytes <op> <group>` for
    each kind of collective it ran."""
    out = {k: row.get(k) for k in COLUMNS}
    out.update(row.get("settings", {}))
    comm = row.get("comm", [])
    if comm:
        out["comm_bytes"] = sum(c["bytes"] for c in comm)
        out["comm_wire_bytes"] = sum(c["wire_bytes"] for c in comm)
    for c in comm:
        out[f"bytes {c['op']} {c['group']}"] = c["bytes"]
    out["error"] = row.get("error", "")
    return out


def write_report(out: Path, rows: list[dict], sweep: dict, command: str) -> None:
    flat = [flat_row(r) for r in rows]
    columns = list(dict.fromkeys(k for r in flat for k in r))
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(flat)
    ok = [r for r in rows if r["status"] == "ok"]
    meta = {"device": ok[0]["device"] if ok else None, "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": command, "sweep": sweep}
    (out / "results.json").write_text(json.dumps({**meta, "points": rows}, indent=1))
    if ok:
        plot(out, ok, meta["device"])


def plot(out: Path, rows: list[dict], device: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, series in _series(rows).items():
        series.sort(key=lambda r: r["devices"])
        x = [r["devices"] for r in series]
        y = [r["tokens_per_s"] for r in series]
        line, = ax.plot(x, y, "o-", label=label)
        ax.plot(x, [y[0] * d / x[0] for d in x], "--", color=line.get_color(), alpha=0.5)
    ax.set(xlabel="devices (tp x dp)", ylabel="tokens/s", title=f"throughput (dashed: linear)\n{device}")
    ax.legend(fontsize=7)
    _save(fig, out / "scaling.png")

    names = [r["point"] for r in rows]
    has_mfu = all(r["mfu"] is not None for r in rows)
    values = [100 * r["mfu"] if has_mfu else r["tflops_per_device"] for r in rows]
    _bars(plt, names, [values], ["MFU" if has_mfu else "TFLOP/s per device"],
          "MFU (%)" if has_mfu else "TFLOP/s per device (no peak known for this device)",
          out / "mfu.png", device)
    _bars(plt, names, [[r["peak_memory_gb"] for r in rows]], [rows[0]["memory_kind"]],
          "peak memory (GiB)", out / "memory.png", device)
    _bars(plt, names, [[r["compute_s"] * 1e3 for r in rows], [r["comm_s"] * 1e3 for r in rows]],
          ["compute", "communication (pipelined: with the waits for neighbours)"],
          "instrumented step (ms)", out / "step.png", device)
    piped = [r for r in rows if r.get("pp", 1) > 1]
    if piped:
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(piped)), 4))
        x = range(len(piped))
        ax.plot(x, [r["pipeline_bubble"] for r in piped], "o", label="(p-1)/(v m), the schedule's")
        ax.plot(x, [r["pipeline_bubble_measured"] for r in piped], "s",
                label="measured: waits / rest of the step")
        ax.set_xticks(list(x), [r["point"] for r in piped], rotation=60, fontsize=7)
        ax.set(ylabel="bubble: idle / compute time", title=device)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        _save(fig, out / "bubble.png")


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        label = ", ".join(f"{setting_name(k)}={v}" for k, v in r["settings"].items()
                          if k != "dp") or "dp only"
        groups.setdefault(label, []).append(r)
    return groups


def _bars(plt, names, stacks, labels, ylabel, path, device) -> None:
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(names)), 4))
    bottom = [0.0] * len(names)
    for values, label in zip(stacks, labels):
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel=ylabel, title=device)
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    ax.legend(fontsize=7)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)
