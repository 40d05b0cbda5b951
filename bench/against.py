"""`python -m bench against COMMIT SWEEP --out DIR`: one bench sweep at an earlier commit and at
the working tree, back to back on this machine. The commit is extracted (git archive) into a
temporary directory and its sweep runs there, its own megalite imported (checked, not assumed)
and its own copy of the sweep's base config read; the sweep file is this tree's, so it must be
valid at both commits. Writes DIR/base/ and DIR/head/ (each sweep's results) and
DIR/comparison.json: device, date, command, both commits, and per point the step time and
peak memory of each with head / base.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.provenance import extract_commit, git_commit, megalite_of
from megalite.command_args import command_parser


def run_sweep(tree: Path, sweep: Path, out: Path, env: dict) -> list[dict]:
    """`python -m bench sweep` with `tree`'s megalite (the working directory comes first on the
    path of `python -m`, and the sweep's torchrun workers inherit both)."""
    env = {**env, "PYTHONPATH": str(tree)}
    megalite_of(tree, env)
    # `megalite bench` before the tools left the package.
    command = ["bench", "sweep"] if (tree / "bench" / "__main__.py").is_file() else ["megalite.cli", "bench"]
    subprocess.run([sys.executable, "-m", *command, str(sweep), "--out", str(out)], cwd=tree, env=env,
                   check=True)
    return json.loads((out / "results.json").read_text())["points"]


def main(argv: list[str]) -> int:
    parser = command_parser("python -m bench against", __doc__)
    parser.add_argument("base", help="the earlier commit")
    parser.add_argument("sweep", help="bench sweep YAML, valid at both commits")
    parser.add_argument("--out", required=True, help="directory for both sweeps and comparison.json")
    args = parser.parse_args(argv)
    sweep, out = Path(args.sweep).resolve(), Path(args.out).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        base_commit = extract_commit(args.base, Path(tmp))
        # The extracted tree has no .git: its sweep records the commit it is told.
        base = run_sweep(Path(tmp), sweep, out / "base", {**os.environ, "MEGALITE_COMMIT": base_commit})
    head = run_sweep(ROOT, sweep, out / "head", dict(os.environ))
    out.mkdir(parents=True, exist_ok=True)
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
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m bench against " + " ".join(argv),
        "base_commit": base_commit, "head_commit": git_commit(), "points": points}, indent=1))
    return 0
