"""`python -m bench compare A B`: two training runs' metrics.jsonl (A and B: run directories or the
files), step by step, as torchtitan's scripts/loss_compare.py does: a table of each metric
(`--metrics`, default loss and grad_norm) in A and B and B - A, then the largest difference of
each and the first step where they differ: |B - A| > atol + rtol |A|, or a value (or the step)
in one run only. `--assert-equal` exits 1 when a step differs (exactly, unless --rtol/--atol
say how close is equal): two layouts, engines or commits that must train alike.

    python -m bench compare runs/tp1 runs/tp2 --rtol 1e-5
    python -m bench compare runs/a runs/b --assert-equal --metrics loss grad_norm val_loss
"""
from __future__ import annotations

import math
from pathlib import Path

from megalite.command_args import command_parser
from megalite.training.metrics import read_records
from megalite.typed_config import ConfigError


def by_step(path: str | Path) -> dict[int, dict]:
    """A run's records merged per step (a step's training record and its evaluation's)."""
    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl there: give a run directory or its metrics.jsonl")
    steps: dict[int, dict] = {}
    for record in read_records(file):
        if "step" in record:
            steps.setdefault(record["step"], {}).update(record)
    return steps


def differ(a, b, rtol: float = 0.0, atol: float = 0.0) -> bool:
    if a is None or b is None or a == b:
        return a != b
    if math.isnan(a) and math.isnan(b):
        return False
    return not abs(b - a) <= atol + rtol * abs(a)  # NaN on one side differs


def compare(a: dict[int, dict], b: dict[int, dict], metrics: list[str], rtol: float = 0.0,
            atol: float = 0.0) -> tuple[list[tuple], tuple | None]:
    """(step, [(metric, A, B)]) for each step where A or B has one of the metrics, and the first
    (step, metric, A, B) that differs (None: none does)."""
    rows, first = [], None
    for step in sorted(set(a) | set(b)):
        values = [(m, a.get(step, {}).get(m), b.get(step, {}).get(m)) for m in metrics]
        if all(x is None and y is None for _, x, y in values):
            continue
        rows.append((step, values))
        if first is None:
            first = next(((step, *v) for v in values if differ(v[1], v[2], rtol, atol)), None)
    return rows, first


def _cell(value) -> str:
    return "-" if value is None else f"{value:.6g}"


def table(rows: list[tuple], metrics: list[str]) -> str:
    lines = ["| step | " + " | ".join(f"{m} A | {m} B | {m} B-A" for m in metrics) + " |",
             "|---:" * (1 + 3 * len(metrics)) + "|"]
    for step, values in rows:
        cells = [f"{_cell(x)} | {_cell(y)} | {_cell(None if x is None or y is None else y - x)}"
                 for _, x, y in values]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = command_parser("python -m bench compare", __doc__)
    parser.add_argument("a", help="run A: a run directory or its metrics.jsonl")
    parser.add_argument("b", help="run B")
    parser.add_argument("--metrics", nargs="+", default=["loss", "grad_norm"], help="the keys compared")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, of A's value")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance")
    parser.add_argument("--assert-equal", action="store_true",
                        help="exit 1, naming the first differing step, unless every step agrees")
    args = parser.parse_args(argv)
    rows, first = compare(by_step(args.a), by_step(args.b), args.metrics, args.rtol, args.atol)
    if not rows:
        raise ConfigError(f"neither run logged any of {', '.join(args.metrics)}")
    print(f"A: {args.a}\nB: {args.b}\n\n{table(rows, args.metrics)}\n")
    for m in args.metrics:
        gaps = [(abs(y - x), step) for step, values in rows for n, x, y in values
                if n == m and x is not None and y is not None]
        if gaps:
            gap, step = max(gaps)
            print(f"{m}: {len(gaps)} steps in both, largest |B-A| {gap:.3g} (step {step})")
    within = f"rtol={args.rtol:g}, atol={args.atol:g}"
    if first is None:
        print(f"equal at every step ({within})")
        return 0
    step, metric, x, y = first
    print(f"first differing step: {step} ({metric}: A {_cell(x)}, B {_cell(y)}; {within})")
    return 1 if args.assert_equal else 0

