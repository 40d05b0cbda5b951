"""One training run of the demo (configs/demo.yaml) in one process, as the CPU benchmark scripts
compare them (scripts/bench_optimizers.py, scripts/bench_fp8_loss.py): its losses and times."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.provenance import cpu_script_header
from megalite.training.metrics import read_records


def demo_bench(doc: str, out: str, steps: int) -> tuple[argparse.Namespace, Path, dict]:
    """A CPU loss benchmark's command line (--out, --steps, --cache), its OUT made, and its
    results' header, taken before the runs (the commit measured)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=out)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--cache", default=".megalite_cache")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args, Path(args.out), cpu_script_header()


def train_demo(settings: list[str], steps: int, cache: str) -> dict:
    """The demo at TP1 (no rank waits on another) with `settings`, `steps` steps: per logged
    step its loss and the seconds since one step before the first; the validation losses."""
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run([sys.executable, "-m", "megalite.train", "--config", "configs/demo.yaml",
                        "parallel.tp=1", *settings, f"train.max_steps={steps}",
                        f"train.eval_every={steps // 3}", "train.checkpoint_every=0",
                        f"run.dir={run_dir}", f"data.cache_dir={cache}", "sample.max_new_tokens=1"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        records = read_records(Path(run_dir) / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    start = train[0]["time"] - (train[1]["time"] - train[0]["time"])
    return {"steps": [r["step"] for r in train], "loss": [r["loss"] for r in train],
            "seconds": [r["time"] - start for r in train],
            "val": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]}
