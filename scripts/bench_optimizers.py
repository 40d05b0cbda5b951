"""AdamW against Muon on the demo: each at a few learning rates, loss against steps and against
wall time, plotted; the result as it comes out.

    python scripts/bench_optimizers.py --out benchmarks/optimizers

The demo (configs/demo.yaml: the tiny preset at 4 layers, the embedded corpus, packed rows of
128 tokens, 16 rows a step) in one process (TP1: no rank waits on another), STEPS steps of the
demo's schedule (warmup, cosine). AdamW sweeps train.lr; Muon sweeps train.muon.lr with the
rest of the model on AdamW at the demo's train.lr. Writes OUT/results.json (device, date,
commit, command, every point's losses and times), OUT/results.csv, OUT/results.md and
OUT/loss_vs_step.png, OUT/loss_vs_time.png.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # bench/ beside megalite
from bench.demo_run import demo_bench, train_demo  # noqa: E402

POINTS = [("adamw", "train.lr", lr) for lr in (1e-3, 3e-3, 1e-2, 3e-2)] + \
         [("muon", "train.muon.lr", lr) for lr in (0.01, 0.02, 0.05)]


def run_point(optimizer: str, key: str, lr: float, steps: int, cache: str) -> dict:
    return {"optimizer": optimizer, "setting": key, "lr": lr,
            **train_demo([f"train.optimizer={optimizer}", f"{key}={lr}"], steps, cache)}


def plot(points: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for x, name, label in (("steps", "loss_vs_step.png", "optimizer step"),
                           ("seconds", "loss_vs_time.png", "wall time (s)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for p in points:
            ax.plot(p[x], p["loss"], label=f"{p['optimizer']} {p['setting'].split('.')[-1]}={p['lr']:g}",
                    linestyle="-" if p["optimizer"] == "muon" else "--", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("training loss")
        ax.set_ylim(top=min(max(p["loss"][0] for p in points), 8.5))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def report(results: dict) -> str:
    lines = [f"AdamW and Muon on the demo (configs/demo.yaml, one process), {results['steps']} "
             f"steps, {results['device']}, commit {results['commit'][:10]}, "
             f"{results['date'][:10]}.", "",
             "| optimizer | learning rate | final training loss | final val loss | seconds |",
             "|---|---|---|---|---|"]
    for p in results["points"]:
        lines.append(f"| {p['optimizer']} | {p['setting']}={p['lr']:g} | {p['loss'][-1]:.3f} | "
                     f"{p['val'][-1][1]:.3f} | {p['seconds'][-1]:.0f} |")
    best = {o: min((p for p in results["points"] if p["optimizer"] == o), key=lambda p: p["val"][-1][1])
            for o in ("adamw", "muon")}
    a, m = best["adamw"], best["muon"]
    winner = "Muon" if m["val"][-1][1] < a["val"][-1][1] else "AdamW"
    lines += ["", f"Best of each by the final validation loss: AdamW at {a['setting']}={a['lr']:g} "
              f"({a['val'][-1][1]:.3f}, {a['seconds'][-1]:.0f} s), Muon at "
              f"{m['setting']}={m['lr']:g} ({m['val'][-1][1]:.3f}, {m['seconds'][-1]:.0f} s): "
              f"{winner} is lower here."]
    return "\n".join(lines) + "\n"


def main() -> None:
    args, out, header = demo_bench(__doc__, "benchmarks/optimizers", 150)
    points = [run_point(o, key, lr, args.steps, args.cache) for o, key, lr in POINTS]
    results = {**header, "steps": args.steps, "points": points}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["optimizer", "setting", "lr", "step", "loss", "seconds"])
        for p in points:
            for step, loss, seconds in zip(p["steps"], p["loss"], p["seconds"]):
                writer.writerow([p["optimizer"], p["setting"], p["lr"], step, loss, f"{seconds:.3f}"])
    (out / "results.md").write_text(report(results))
    plot(points, out)
    print(report(results))


if __name__ == "__main__":
    main()
