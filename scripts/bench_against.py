"""Run one `python -m bench sweep` sweep at an earlier commit and at the working tree, back to back on
this machine, and write both results side by side with their ratios.

    python scripts/bench_against.py 4db1574 configs/bench/head-memory.yaml \
        --out benchmarks/cpu/head-memory

The earlier commit is extracted (git archive) into a temporary directory and its bench runs
there, its own `megalite` imported (checked, not assumed) and its own copy of the sweep's base
config read; the sweep file is this tree's, so it must be valid at both commits. Writes
OUT/base/ and OUT/head/ (each bench's own results) and OUT/comparison.json: device, date,
command, both commits, and per point the step time and peak memory of each with head / base.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # bench/ beside megalite
from bench.provenance import extract_commit, git_commit, megalite_of  # noqa: E402


def run_bench(tree: Path, sweep: Path, out: Path, env: dict = os.environ) -> list[dict]:
    """`python -m bench sweep` with `tree`'s megalite (the working directory comes first on the path
    of `python -m`, and the bench's torchrun workers inherit both)."""
    env = {**env, "PYTHONPATH": str(tree)}
    megalite_of(tree, env)
    # The sweep command of that tree: `megalite bench` before the tools left the package.
    moved = (tree / "bench" / "__main__.py").is_file()
    sweep_command = ["bench", "sweep"] if moved else ["megalite.cli", "bench"]
    subprocess.run([sys.executable, "-m", *sweep_command, str(sweep), "--out", str(out)],
                   cwd=tree, env=env, check=True)
    return json.loads((out / "results.json").read_text())["points"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the earlier commit")
    parser.add_argument("sweep", help="bench sweep YAML, valid at both commits")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    sweep, out = Path(args.sweep).resolve(), Path(args.out).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        base_commit, tree = extract_commit(args.base, Path(tmp))
        # The extracted tree has no .git: its bench records the commit it is told.
        base = run_bench(tree, sweep, out / "base", {**os.environ, "MEGALITE_COMMIT": base_commit})
    head = run_bench(ROOT, sweep, out / "head")

    points = []
    for b, h in zip(base, head):
        row = {"point": h["point"], "status": {"base": b["status"], "head": h["status"]}}
        if b["status"] == h["status"] == "ok":
            for key in ("step_s", "peak_memory_gb"):
                row[key] = {"base": b[key], "head": h[key], "head_over_base": h[key] / b[key]}
        points.append(row)
        print(json.dumps(row), flush=True)
    (out / "comparison.json").write_text(json.dumps({
        "device": head[0].get("device"), "memory_kind": head[0].get("memory_kind"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_against.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "base_commit": base_commit, "head_commit": git_commit(),
        "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
