"""FP8 against bf16 on the demo: does training in FP8 reach bf16's loss?

    python scripts/bench_fp8_loss.py --out benchmarks/fp8-loss

The demo (configs/demo.yaml: the tiny preset at 4 layers, the embedded corpus, packed rows of
128 tokens, 16 rows a step) in one process, STEPS steps, train.precision=bf16 (autocast), then
each torchao recipe with every block linear in FP8 (train.fp8.layers=all: the demo's layers are
far below torchao's size filter) emulated (FP8 casts, fp32 products: this CPU has no FP8
matmul that is not one). The claim checked: each FP8 run's final loss within 2 % of bf16's.
Writes OUT/results.json (device, date, commit, command, every run's losses and times),
OUT/results.csv, OUT/results.md and OUT/loss_vs_step.png.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # bench/ beside megalite
from bench.demo_run import demo_bench, train_demo  # noqa: E402

RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")
WITHIN = 0.02


def run(recipe: str, steps: int, cache: str) -> dict:
    fp8 = [] if recipe == "none" else [f"train.fp8.recipe={recipe}", "train.fp8.layers=all",
                                       "train.fp8.emulate=true"]
    return {"recipe": recipe, **train_demo(["train.precision=bf16", *fp8], steps, cache)}


def final(run: dict) -> float:
    """The mean training loss of the last 10 logged steps (one step's loss is one batch's)."""
    return sum(run["loss"][-10:]) / len(run["loss"][-10:])


def report(results: dict) -> str:
    runs = results["runs"]
    bf16 = final(runs[0])
    lines = [f"FP8 (emulated) and bf16 on the demo (configs/demo.yaml, one process), "
             f"{results['steps']} steps, {results['device']}, commit {results['commit'][:10]}, "
             f"{results['date'][:10]}. Final loss: the mean of the last 10 steps' training losses.",
             "", "| run | final loss | vs bf16 | final val loss | seconds | within 2 % |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        change = final(r) / bf16 - 1
        lines.append(f"| {'bf16' if r['recipe'] == 'none' else r['recipe']} | {final(r):.4f} | "
                     f"{change:+.2%} | {r['val'][-1][1]:.4f} | {r['seconds'][-1]:.0f} | "
                     f"{'yes' if abs(change) <= WITHIN else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.plot(r["steps"], r["loss"], linewidth=1, label="bf16" if r["recipe"] == "none" else
                f"fp8 {r['recipe']} (emulated)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_ylim(top=min(max(r["loss"][0] for r in runs), 8.5))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_vs_step.png", dpi=110)
    plt.close(fig)


def main() -> None:
    args, out, header = demo_bench(__doc__, "benchmarks/fp8-loss", 300)
    runs = [run(recipe, args.steps, args.cache) for recipe in RECIPES]
    results = {**header, "steps": args.steps, "within": WITHIN, "runs": runs}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["recipe", "step", "loss", "seconds"])
        for r in runs:
            for step, loss, seconds in zip(r["steps"], r["loss"], r["seconds"]):
                writer.writerow([r["recipe"], step, loss, f"{seconds:.3f}"])
    (out / "results.md").write_text(report(results))
    plot(runs, out)
    print(report(results))


if __name__ == "__main__":
    main()
