"""A rank killed 5 times at seeded random steps: how long until the run trains its next step,
how many steps it lost, and whether it ends as the uninterrupted run does, for the in-memory
snapshot path (train.snapshot_every) against the disk checkpoint's (train.checkpoint_every).

    python scripts/bench_recovery.py --out benchmarks/recovery

The demo's model at TP2 x DP2 on 2 nodes of 2 processes (two `megalite torchrun
--max-restarts 5` agents on this machine: bench/nodes.py; CPU, gloo), a snapshot every
SNAPSHOT_EVERY steps or a disk checkpoint every DISK_EVERY. The script watches
metrics.jsonl; at each chosen step it SIGKILLs a chosen rank and measures, from the kill, the
wall time to the first step record written after it (the launcher's restart, the imports, the
data index, the state loaded, one step). Also: the snapshot files' bytes per rank, and each
path's median tokens/s against a run with neither (the overhead). Writes OUT/results.json (device, date, commit, command, every
kill), OUT/results.csv and OUT/recovery.png.
"""
from __future__ import annotations

import csv
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
from bench.demo_run import demo_bench  # noqa: E402
from bench.nodes import Nodes  # noqa: E402
from megalite.training.metrics import read_records  # noqa: E402

STEPS, KILLS, SEED, RANKS = 60, 5, 0, 4
# A snapshot every 2 steps, a disk checkpoint every 10 (as often as each path's cost allows
# at scale: a snapshot is a copy to host memory, a checkpoint a write to shared storage).
SNAPSHOT_EVERY, DISK_EVERY = 2, 10
PATHS = {"snapshot": [f"train.snapshot_every={SNAPSHOT_EVERY}", "train.checkpoint_every=0"],
         "disk": [f"train.checkpoint_every={DISK_EVERY}"], "neither": ["train.checkpoint_every=0"]}


def train_args(run_dir: Path, cache: str, path: str) -> list[str]:
    return ["--config", "configs/demo.yaml", "parallel.tp=2", "train.global_batch_size=8",
            "train.micro_batch_size=4", f"train.max_steps={STEPS}", "train.eval_every=0",
            f"run.dir={run_dir}", f"data.cache_dir={cache}", "sample.max_new_tokens=1",
            *PATHS[path]]


def size(f: Path) -> int:
    try:
        return f.stat().st_size
    except FileNotFoundError:  # dropped meanwhile: the next snapshot was agreed
        return 0


def records(run_dir: Path) -> list[dict]:
    try:
        return [r for r in read_records(run_dir / "metrics.jsonl") if "loss" in r]
    except (OSError, ValueError):
        return []


def run(path: str, cache: str, kills: list[tuple[int, int]]) -> dict:
    """The run with SIGKILLs at (step, rank): per kill the recovery seconds and steps lost."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        nodes = Nodes(Path(tmp), train_args(run_dir, cache, path), max_restarts=KILLS)
        nodes.start("a")
        nodes.start("b")
        shm = nodes.memory("a")
        events, snapshot_bytes = [], 0
        for step, rank in kills:
            while nodes.running() and (not records(run_dir) or records(run_dir)[-1]["step"] < step):
                snapshot_bytes = max([snapshot_bytes] + [size(f) for f in shm.glob("step_*.rank_0.safetensors")])
                time.sleep(0.005)
            if not nodes.running():
                nodes.wait()  # raises, with the agents' output
            reached = records(run_dir)[-1]["step"]
            killed_at = time.time()
            nodes.workers()[rank].kill()
            while nodes.running() and not [r for r in records(run_dir) if r["time"] > killed_at]:
                time.sleep(0.005)
            after = [r for r in records(run_dir) if r["time"] > killed_at][0]
            events.append({"step_killed": reached + 1, "rank": rank, "resumed_at": after["step"] - 1,
                           "steps_lost": reached - (after["step"] - 1),
                           "recovery_s": after["time"] - killed_at})
        out = nodes.wait(timeout=1800)  # raises, with the agents' output, unless both ended well
        final = records(run_dir)
        # Rank 0 says what the first snapshot of each start cost the step: the copy to host memory.
        staged = [int(ms) for ms in re.findall(r"snapshot of step \d+: [\d.]+ MiB on rank 0, "
                                               r"staged in (\d+) ms", out)]
        return {"path": path, "kills": events, "loss": [r["loss"] for r in final],
                "tokens_per_s": [r["tokens_per_s"] for r in final],
                "snapshot_bytes_per_rank": snapshot_bytes, "staging_ms": staged}


def main() -> None:
    args, out, header = demo_bench(__doc__, "benchmarks/recovery", STEPS)
    rng = random.Random(SEED)
    kills = sorted(zip(sorted(rng.sample(range(DISK_EVERY + 2, STEPS - 3), KILLS)),
                       [rng.randrange(RANKS) for _ in range(KILLS)]))
    whole = run("neither", args.cache, [])
    runs = {p: run(p, args.cache, kills) for p in ("snapshot", "disk")}
    # The overhead without kills: the intervals after a restart are slower (warm-up).
    unkilled = {p: run(p, args.cache, []) for p in ("snapshot", "disk")}
    results = {**header, "command": "python scripts/bench_recovery.py " + " ".join(sys.argv[1:]),
               "steps": STEPS, "snapshot_every": SNAPSHOT_EVERY, "checkpoint_every": DISK_EVERY,
               "kills": kills, "uninterrupted": whole, "runs": runs, "without_kills": unkilled}
    for r in [*runs.values(), *unkilled.values(), whole]:
        r["bit_identical"] = r["loss"] == whole["loss"]
        r["median_tokens_per_s"] = sorted(r["tokens_per_s"])[len(r["tokens_per_s"]) // 2]
    for r in unkilled.values():
        r["overhead"] = 1 - r["median_tokens_per_s"] / whole["median_tokens_per_s"]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "step_killed", "rank", "resumed_at", "steps_lost", "recovery_s"])
        for name, r in runs.items():
            for e in r["kills"]:
                w.writerow([name, e["step_killed"], e["rank"], e["resumed_at"], e["steps_lost"],
                            f"{e['recovery_s']:.2f}"])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (name, r) in enumerate(runs.items()):
        ax.bar([k + 0.4 * i for k in range(KILLS)], [e["recovery_s"] for e in r["kills"]], 0.4,
               label=f"{name} (lost {sum(e['steps_lost'] for e in r['kills'])} steps)")
    ax.set_xticks([k + 0.2 for k in range(KILLS)], [f"step {s}" for s, _ in kills])
    ax.set_ylabel("kill to next step trained (s)")
    ax.set_title(f"{header.get('device', 'CPU')}: TP2 x DP2 on 2 nodes; snapshot every {SNAPSHOT_EVERY} steps, "
                 f"checkpoint every {DISK_EVERY}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "recovery.png", dpi=120)
    for name, r in runs.items():
        rec = [e["recovery_s"] for e in r["kills"]]
        print(f"{name}: recovery {min(rec):.1f}-{max(rec):.1f} s, steps lost "
              f"{sum(e['steps_lost'] for e in r['kills'])}, bit-identical {r['bit_identical']}, "
              f"tokens/s {r['median_tokens_per_s']:.0f} vs {whole['median_tokens_per_s']:.0f}; "
              f"without kills {unkilled[name]['median_tokens_per_s']:.0f} "
              f"({100 * unkilled[name]['overhead']:.1f}% overhead)")


if __name__ == "__main__":
    main()
