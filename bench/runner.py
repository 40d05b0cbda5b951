"""`python -m bench sweep SWEEP.yaml --out DIR`: run a throughput sweep, one torchrun launch per point.

    name: cpu-tiny
    base: configs/demo.yaml                     # the run config every point starts from
    overrides: [model=tiny, data.seq_len=64]    # every point
    grid: {parallel.tp: [1, 2], dp: [1, 2]}     # the cartesian product...
    points: [{}, {parallel.sequence_parallel: true}]   # ...times each of these
    batch: full                                 # or packed
    warmup_steps: 2
    steps: 5

Besides run-config keys, a point may set `dp` (DP ranks; devices = tp x cp x pp x dp, default 1),
`scaling`: strong (default; the global batch stays as configured) or weak (the global batch
grows with dp, so each DP rank keeps its share), and `batch` (the sweep's by default): full
(random full-length rows, one document each) or packed (rows of several random-length
documents with their boundaries, as data.mode=packed trains; see bench/point.py). Every point
is checked before anything starts: a bad one is recorded as `invalid` with the reason and the
sweep goes on, as it does past a point that fails (`failed`, or `oom`) or runs past
`timeout_s` (`timeout`); with `--time-limit-s`, points not started within it are `skipped`. Results: DIR/results.csv,
DIR/results.json (device, torch version, date, git commit, the command) and DIR/*.png; each
point's log and spec under DIR/points/. Exit status 1 when any point did not finish.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from bench import on_path
from bench.report import write_report
from megalite.command_args import command_parser
from megalite.launch.sweep import expand, short_name
from megalite.run_config import load_config
from megalite.plan import validate
from megalite.typed_config import ConfigError, from_dict

BENCH_KEYS = ("dp", "scaling", "batch")
BATCHES = ("full", "packed")


@dataclass(frozen=True)
class BenchSweep:
    name: str
    base: str
    overrides: list[str] = field(default_factory=list)
    grid: dict = field(default_factory=dict)
    points: list = field(default_factory=list)
    batch: Literal["full", "packed"] = "full"  # a point's `batch` overrides it
    warmup_steps: int = 2
    steps: int = 5
    timeout_s: float = 600.0  # per point


@dataclass
class Point:
    index: int
    name: str
    settings: dict  # the sweep's keys for this point, as written
    world: int
    overrides: list[str]
    batch: str = "full"
    error: str = ""  # why it cannot run, found before launching


def load_bench(path: Path) -> tuple[BenchSweep, list[Point]]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"bench sweep file '{path}' not found")
    sweep = from_dict(BenchSweep, yaml.safe_load(path.read_text()) or {}, "bench.")
    if not Path(sweep.base).is_file():
        raise ConfigError(f"bench.base '{sweep.base}' not found: name a run config (e.g. "
                          f"configs/demo.yaml)")
    if sweep.steps < 1 or sweep.warmup_steps < 0:
        raise ConfigError(f"bench.steps={sweep.steps} must be >= 1 and bench.warmup_steps="
                          f"{sweep.warmup_steps} >= 0")
    return sweep, [_point(sweep, i, p) for i, p in enumerate(expand(sweep.name, sweep.grid, sweep.points))]


def _point(sweep: BenchSweep, index: int, settings: dict) -> Point:
    dp, scaling = settings.get("dp", 1), settings.get("scaling", "strong")
    overrides = sweep.overrides + [f"{k}={v}" for k, v in settings.items() if k not in BENCH_KEYS]
    point = Point(index, f"{index}-{short_name(settings)}", settings, 0, overrides,
                  settings.get("batch", sweep.batch))
    try:
        if not isinstance(dp, int) or dp < 1 or scaling not in ("strong", "weak"):
            raise ConfigError(f"dp={dp!r} must be a positive integer and scaling={scaling!r} "
                              f"strong or weak")
        if point.batch not in BATCHES:
            raise ConfigError(f"batch={point.batch!r} must be one of {', '.join(BATCHES)}")
        cfg = load_config(sweep.base, overrides)
        if scaling == "weak":
            batch = cfg.train.global_batch_size * dp
            point.overrides.append(f"train.global_batch_size={batch}")
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=batch))
        point.world = cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp * dp
        validate(cfg, point.world)
    except ConfigError as err:
        point.error = str(err)
    return point


INCOMPLETE = 3  # the exit code of a sweep whose only missing results are those its time limit cut
CUT = "the sweep's --time-limit-s"  # in the error of a point the sweep's limit stopped


def cut_short(row: dict) -> bool:
    """Whether the sweep's time limit, not the point itself, kept this row from a result."""
    return row["status"] == "skipped" or (row["status"] == "timeout" and CUT in row["error"])


def run_point(sweep: BenchSweep, point: Point, out: Path, time_left: float | None = None,
              resume: bool = False) -> dict:
    """One point's row. `time_left`: seconds left of the sweep's --time-limit-s (None: no
    limit); a point gets the smaller of that and bench.timeout_s, and none when none is left.
    `resume`: the row an earlier run of this same point left (any end but one the time limit
    cut), instead of running it again."""
    row = {"point": point.name, "settings": point.settings}
    if point.error:
        return {**row, "status": "invalid", "error": point.error}
    directory = out / "points" / point.name
    spec_text = json.dumps({"config": str(Path(sweep.base).resolve()),
                            "overrides": point.overrides, "batch": point.batch,
                            "warmup": sweep.warmup_steps,
                            "steps": sweep.steps, "out": str(directory / "result.json")})
    ended = directory / "row.json"
    if resume and ended.is_file() and (directory / "spec.json").read_text() == spec_text:
        return json.loads(ended.read_text())
    if time_left is not None and time_left <= 0:
        return {**row, "status": "skipped", "error": f"not started: {CUT} was spent"}
    timeout, limit = ((sweep.timeout_s, f"bench.timeout_s={sweep.timeout_s}")
                      if time_left is None or sweep.timeout_s <= time_left
                      else (time_left, CUT))
    directory.mkdir(parents=True, exist_ok=True)
    ended.unlink(missing_ok=True)
    (directory / "spec.json").write_text(spec_text)
    row = _run_spec(row, point, directory, timeout, limit)
    if not cut_short(row):
        ended.write_text(json.dumps(row))
    return row


def _run_spec(row: dict, point: Point, directory: Path, timeout: float, limit: str) -> dict:
    spec = directory / "spec.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={point.world}", "-m", "bench.point", str(spec)]
    # One thread per process unless the user says otherwise, also for a single process, so
    # that points with different process counts compare like with like. A rank that crashes
    # prints its threads' Python stacks into the log (faulthandler).
    env = on_path({**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                   "PYTHONFAULTHANDLER": "1"})
    log = directory / "log.txt"
    code, timed_out = run_in_session(command, log, env, timeout)
    if timed_out:
        return {**row, "status": "timeout", "error": f"over {limit}"}
    if code == 0:
        return {**row, "status": "ok", **json.loads((directory / "result.json").read_text())}
    text = log.read_text(errors="replace")
    status = "oom" if "out of memory" in text.lower() else "failed"
    return {**row, "status": status, "error": _reason(text) + f" (log: {log})"}


def run_in_session(command: list[str], log: Path, env: dict, timeout: float,
                   cwd: Path | None = None) -> tuple[int, bool]:
    """(exit status, whether it ran past `timeout` s) of `command` run in its own session, its
    output into `log`; past the timeout, stopped with everything it started (stop_session)."""
    with log.open("w") as f:
        proc = subprocess.Popen(command, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            stop_session(proc)
            return proc.returncode, True


def stop_session(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stop a process started in its own session, and what it started. SIGTERM first: torchrun
    then stops its workers, which run in sessions of their own that a kill of torchrun's group
    would miss (left running, they would hold the GPU through the next points)."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _reason(log_text: str) -> str:
    """Why a point failed, from its torchrun log: megalite's own error if a rank printed one,
    else a failed rank, its exit code (a crash leaves only a signal) and the exception it
    raised. Torchrun's root cause comes first unless it only lost its peer ('connection closed
    by peer': it names whichever rank's failure torchrun saw first, often a bystander's)."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for line in lines:
        if "megalite: error" in line:
            return line
    root = next((i for i, line in enumerate(lines) if line.startswith("Root Cause")), len(lines))
    failed = {}  # rank -> exit code, the root cause's first
    for i in [*range(root, len(lines)), *range(root)]:
        if lines[i].startswith("rank ") and i + 1 < len(lines) and lines[i + 1].startswith("exitcode "):
            rank = lines[i].split(":", 1)[1].split()[0]
            failed.setdefault(rank, " ".join(lines[i + 1].split(":", 1)[1].split()))
    if not failed:
        errors = [line for line in lines if "Error" in line]
        return (errors or lines or ["no output"])[-1]
    reasons = []
    for rank, exit_code in failed.items():
        raised = [line.split(":", 1)[1].strip() for line in lines if line.startswith(f"[rank{rank}]:")
                  and _EXCEPTION.match(line.split(":", 1)[1].strip())]
        reasons.append((bool(raised) and _PEER_LOST.search(raised[-1]) is not None,
                        f"rank {rank} exited with {exit_code}" + (f": {raised[-1]}" if raised else "")))
    return next((reason for lost, reason in reasons if not lost), reasons[0][1])


# A rank that failed only because another rank died (gloo's and NCCL's words for it).
_PEER_LOST = re.compile(r"closed by peer|Connection reset|Broken pipe|remote process exited", re.I)


# The last line of a Python traceback: "SomeError: message" or "pkg.mod.SomeError: message".
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("python -m bench sweep", __doc__)
    parser.add_argument("sweep", help="bench sweep YAML (see configs/bench/)")
    parser.add_argument("--out", required=True, help="directory for results and plots")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="the whole sweep's limit: points not started by then are recorded "
                             "as skipped, and the results are written (a GPU lease); exit code "
                             f"{INCOMPLETE} when that left points without a result")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows an earlier run in --out left for the same points; "
                             "run the others (those the time limit cut, or new ones)")
    args = parser.parse_args(argv)
    deadline = None if args.time_limit_s is None else time.monotonic() + args.time_limit_s
    sweep, points = load_bench(Path(args.sweep))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for point in points:
        row = run_point(sweep, point, out,
                        None if deadline is None else deadline - time.monotonic(), args.resume)
        rows.append(row)
        shown = (f"{row['tokens_per_s']:,.0f} tokens/s, {row['step_s'] * 1e3:.1f} ms/step"
                 if row["status"] == "ok" else row["error"])
        print(f"[{point.index + 1}/{len(points)}] {point.name}: {row['status']}: {shown}", flush=True)
    command = "python -m bench sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    write_report(out, rows, dataclasses.asdict(sweep), command)
    print(f"wrote {out / 'results.csv'}, {out / 'results.json'} and plots", flush=True)
    if all(r["status"] == "ok" for r in rows):
        return 0
    return INCOMPLETE if all(r["status"] == "ok" or cut_short(r) for r in rows) else 1


if __name__ == "__main__":
    from megalite.cli import run_reporting_errors
    sys.exit(run_reporting_errors(main, sys.argv[1:]))
