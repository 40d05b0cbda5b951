"""`python -m bench gpu-check --out DIR` (scripts/gpu_check.sh): the GPU proof in one command.

On one H100/H200, within --budget-min (7: one of two calls in a 15-minute lease): the GPU tests
(tests/test_gpu*.py), `python -m bench sweep` on configs/bench/gpu-check.yaml (GPT-2 small at
1024, the 1B Llama at 2048; eager and compiled; full and packed rows), on
configs/bench/gpu-train.yaml (the same models compiled, an optimizer step every ~0.5M tokens,
bf16 and pure_bf16), on configs/bench/gpu-compile.yaml (GPT-2 small compiled by default, as
CUDA graphs, with inductor's tuning) and on configs/bench/gpu-fp8.yaml (compiled, bf16 against
FP8 recipes),
then `python -m bench peer` at the first sweep's shapes on full and on packed rows
(--compile both --max-batch --profile). Every JSON goes into DIR with the device, torch and
CUDA versions, date, commit and command, and one DIR/summary.md table (bench/gpu_summary.py)
is written at the end and printed.

Each step is its own process, run in this order (what matters most first) with a time limit:
the budget left, at most the step's own cap. A step that fails or runs out of time is
recorded in DIR/steps.json and the rest go on. Run again with the same DIR and the steps that
ended (ok or failed) are kept, a sweep keeps its finished points, and the others run; a step
that is not a sweep starts only with its whole cap left. The caps of the tests, bench and
bench-train add up to less than two calls; compile settings, FP8 and peer-bench follow. It uses the machine's
own torch and installs nothing.
`--dry-run` launches nothing: it checks that every config and command line it would run is
valid and prints what the caps add up to (tests/test_gpu_check.py runs it on CPU, so the
command cannot rot).
"""
from __future__ import annotations

import contextlib
import datetime
import importlib.util
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import ROOT, on_path, peer
from bench.gpu_summary import SWEEP_KINDS, write_summary
from bench.point import device_name
from bench.provenance import git_commit
from bench.runner import INCOMPLETE, load_bench, run_in_session
from megalite.command_args import command_parser
from megalite.typed_config import ConfigError

# Each step's own cap, seconds (the budget left may cut it shorter): about 1.5x what the tests
# took on the H200 and the H100 (2026-11-26); for the sweeps at their new shapes a guess from
# those. The tests and the first two sweeps fit two calls of --budget-min CALL_MIN (one
# 15-minute lease); the LATER kinds follow in what is left, or in a later call.
TESTS = {"tests-gpu": ("tests/test_gpu.py", 90.0), "tests-kernels": ("tests/test_gpu_kernels.py", 30.0),
         "tests-train": ("tests/test_gpu_train.py", 120.0)}
SWEEP = "configs/bench/gpu-check.yaml"
TRAIN_SWEEP = "configs/bench/gpu-train.yaml"
FP8_SWEEP = "configs/bench/gpu-fp8.yaml"
COMPILE_SWEEP = "configs/bench/gpu-compile.yaml"
PEER_FLAGS = "--compile both --max-batch --profile"
STEP_KINDS = ("tests", "bench", "train", "compile", "fp8", "peer")
# compile: five GPT-2 compiles (~40 s each on the H200) and coordinate-descent tuning's, a guess
CAPS = {"bench": 300.0, "train": 240.0, "compile": 360.0, "fp8": 240.0, "peer": 240.0}
CALL_MIN = 7.0
LATER = ("compile", "fp8", "peer")
# What a sweep step keeps of its limit to write its report and plots after the last point.
REPORT_MARGIN_S = 45.0
ENDED = ("ok", "failed")


@dataclass(frozen=True)
class Step:
    name: str
    kind: str
    argv: list[str]  # after the Python interpreter
    output: str  # what it writes, relative to DIR
    cap: float  # seconds


def shown(argv: list[str]) -> str:
    """A step's command line as steps.json and the dry run show it."""
    return " ".join(["python", *argv])


def sweep_step(name: str, kind: str, sweep: str, out: Path) -> Step:
    # --resume: a second call keeps the points the first finished.
    return Step(name, kind, ["-m", "bench", "sweep", sweep, "--out", str(out / name), "--resume"],
                f"{name}/results.json", CAPS[kind])


def plan(out: Path, sweep: str, peer_flags: str, skip: list[str], fp8_sweep: str = FP8_SWEEP,
         train_sweep: str = TRAIN_SWEEP, compile_sweep: str = COMPILE_SWEEP) -> list[Step]:
    steps = []
    if "tests" not in skip:
        # One step per file: each has its own limit and result, and a test's time shows in its
        # log (-v, --durations) even when the step runs out of time.
        for name, (path, cap) in TESTS.items():
            # -o addopts=: one process (the suite's own -n 2 would share the one GPU).
            steps.append(Step(name, "tests", ["-m", "pytest", path, "-v", "-rfEs", "--durations=0",
                                              "-p", "no:cacheprovider", "-o", "addopts=",
                                              "--junitxml", str(out / f"{name}.xml")],
                              f"{name}.xml", cap))
    for kind, name, path in (("bench", "bench", sweep), ("train", "bench-train", train_sweep),
                             ("compile", "bench-compile", compile_sweep),
                             ("fp8", "bench-fp8", fp8_sweep)):
        if kind not in skip:
            steps.append(sweep_step(name, kind, path, out))
    if "peer" not in skip:
        for batch in ("full", "packed"):
            for model, seq, micro in peer_shapes(sweep):
                name = f"peer-{model}-{seq}-{batch}"
                steps.append(Step(name, "peer", ["-m", "bench", "peer", "--model", model, "--seq-len", str(seq),
                                                 "--micro-batch", str(micro), "--batch", batch,
                                                 *peer_flags.split(), "--out", str(out / f"{name}.json")],
                                  f"{name}.json", CAPS["peer"]))
    return steps


def calls_needed(steps: list[Step], call_min: float = CALL_MIN) -> float:
    """How many calls of call_min minutes the steps' caps add up to."""
    return sum(step.cap for step in steps) / (call_min * 60)


def peer_shapes(sweep: str) -> list[tuple[str, int, int]]:
    """The sweep's distinct (model, seq_len, micro-batch), in order: peer-bench's shapes."""
    _, points = load_bench(Path(sweep))
    shapes = []
    for point in points:
        keys = ("model", "data.seq_len", "train.micro_batch_size")
        missing = [k for k in keys if k not in point.settings]
        if missing:
            raise ConfigError(f"gpu-check sweep {sweep}: point {point.name} does not name "
                              f"{', '.join(missing)}; each point names {', '.join(keys)} (peer-bench runs them)")
        shape = tuple(point.settings[k] for k in keys)
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def check(steps: list[Step]) -> dict[str, str]:
    """What keeps each step from running (none: it can), by step name."""
    problems = {}
    tests = {step.argv[step.argv.index("pytest") + 1]: step.name for step in steps if step.kind == "tests"}
    # One pytest collects every test file (each start imports torch); one per file only when that
    # fails, to say which.
    if tests and _collect(list(tests)).returncode != 0:
        for path, name in tests.items():
            collect = _collect([path])
            if not (ROOT / path).is_file() or collect.returncode != 0:
                problems[name] = f"{path} does not collect: {(collect.stdout + collect.stderr)[-2000:]}"
    for step in steps:
        if step.kind in SWEEP_KINDS:
            _, points = load_bench(Path(step.argv[step.argv.index("sweep") + 1]))
            bad = [f"point {p.name}: {p.error}" for p in points if p.error]
            if bad:
                problems[step.name] = "; ".join(bad)
        elif step.kind == "peer":
            usage = io.StringIO()
            try:
                with contextlib.redirect_stderr(usage):
                    peer.parse_args(step.argv[step.argv.index("peer") + 1:])
            except ConfigError as err:
                problems[step.name] = str(err)
            except SystemExit:  # argparse's refusal: its message is its last line
                problems[step.name] = usage.getvalue().strip().splitlines()[-1]
    return problems


def _collect(paths: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", *paths],
                          cwd=ROOT, capture_output=True, text=True)


# What the steps import beyond torch: a GPU machine's own Python may lack some, and a step
# that needs one fails; the run records which were missing up front.
PACKAGES = ("numpy", "yaml", "safetensors", "tokenizers", "tqdm", "matplotlib", "pyarrow", "pytest",
            "transformers")


def environment(argv: list[str]) -> dict:
    cuda = torch.cuda.is_available()
    smi = shutil.which("nvidia-smi")
    driver = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip() if smi else None
    return {"device": device_name(torch.device("cuda" if cuda else "cpu")), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "nvidia_smi": driver,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "command": "python -m bench gpu-check " + " ".join(argv),
            "missing_packages": [p for p in PACKAGES if importlib.util.find_spec(p) is None]}


def run_step(step: Step, out: Path, limit: float) -> dict:
    argv = step.argv + (["--time-limit-s", f"{max(limit - REPORT_MARGIN_S, 1):.0f}"]
                        if step.kind in SWEEP_KINDS else [])
    record = {"command": shown(argv), "output": step.output, "log": f"logs/{step.name}.log",
              "limit_s": round(limit)}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    # The repository on the path: the machine's own Python runs megalite uninstalled.
    env = on_path({**os.environ, "PYTHONUNBUFFERED": "1"})
    started = time.monotonic()
    code, timed_out = run_in_session([sys.executable, *argv], out / record["log"], env, limit, ROOT)
    # A sweep its time limit cut keeps its finished points; the next call runs the rest.
    status = ("timeout" if timed_out else "ok" if code == 0 else
              "incomplete" if step.kind in SWEEP_KINDS and code == INCOMPLETE else "failed")
    return {**record, "status": status, "returncode": code, "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = command_parser("python -m bench gpu-check", __doc__)
    parser.add_argument("--out", required=True, help="directory for every result and summary.md")
    parser.add_argument("--budget-min", type=float, default=CALL_MIN,
                        help="this invocation's time, minutes (one of two calls in a 15-minute lease)")
    parser.add_argument("--dry-run", action="store_true", help="check every config and command line; run nothing")
    parser.add_argument("--sweep", default=SWEEP, help="the bench sweep (its points give peer-bench's shapes)")
    parser.add_argument("--train-sweep", default=TRAIN_SWEEP,
                        help="the training-shaped sweep (an optimizer step every ~0.5M tokens)")
    parser.add_argument("--compile-sweep", default=COMPILE_SWEEP, help="the compile-settings sweep")
    parser.add_argument("--fp8-sweep", default=FP8_SWEEP, help="the FP8 sweep")
    parser.add_argument("--peer-flags", default=PEER_FLAGS, help="peer-bench's flags besides the shape")
    parser.add_argument("--skip", action="append", default=[], choices=STEP_KINDS, help="leave out a kind of step")
    parser.add_argument("--redo", action="append", default=[], help="run this step again even if it ended")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_min * 60  # the checks below count against it
    out = Path(args.out).resolve()
    steps = plan(out, args.sweep, args.peer_flags, args.skip, args.fp8_sweep, args.train_sweep,
                 args.compile_sweep)
    problems = check(steps)
    if args.dry_run:
        if problems:
            raise ConfigError("gpu-check would launch what cannot run:\n  " +
                              "\n  ".join(f"{name}: {why}" for name, why in problems.items()))
        for step in steps:
            print(f"{step.name}: {shown(step.argv)}")
        first = [step for step in steps if step.kind not in LATER]
        later = sum(step.cap for step in steps if step.kind in LATER) / 60
        print(f"gpu-check: caps of {', '.join(dict.fromkeys(s.kind for s in first))} "
              f"{calls_needed(first, args.budget_min):.2f} calls of --budget-min {args.budget_min:g}; "
              f"then {', '.join(LATER)} {later:.0f} min")
        print(f"gpu-check: {len(steps)} steps valid (dry run: nothing launched)")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / "steps.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {"runs": [], "steps": {}}
    state["runs"].append(environment(argv))
    for step in steps:
        previous = state["steps"].get(step.name, {})
        if previous.get("status") in ENDED and step.name not in args.redo:
            print(f"{step.name}: {previous['status']} in an earlier run, kept", flush=True)
            continue
        left = deadline - time.monotonic()
        unrun = {"output": step.output, "command": shown(step.argv)}
        if step.name in problems:  # one step that cannot run does not stop the others
            state["steps"][step.name] = {"status": "failed", **unrun,
                                         "reason": f"not launched: {problems[step.name]}"}
        elif left < 30 or (step.kind not in SWEEP_KINDS and left < step.cap):
            # A sweep keeps its finished points for the next call; any other step would start
            # over there: it waits for a call with its whole cap left.
            state["steps"][step.name] = {"status": "not run", **unrun,
                                         "reason": f"the budget of {args.budget_min} min was spent"
                                         + (f" (less than its cap of {step.cap:.0f} s left)"
                                            if left >= 30 else "")}
        else:
            print(f"{step.name}: running (limit {min(step.cap, left):.0f} s)", flush=True)
            state["steps"][step.name] = run_step(step, out, min(step.cap, left))
        print(f"{step.name}: {state['steps'][step.name]['status']}", flush=True)
        state_file.write_text(json.dumps(state, indent=1))  # after each step: a cut lease keeps them
    state_file.write_text(json.dumps(state, indent=1))
    summary = write_summary(out, [asdict(s) for s in steps], state)
    print(summary, flush=True)
    return 0 if all(state["steps"][s.name]["status"] == "ok" for s in steps) else 1


if __name__ == "__main__":
    from megalite.cli import run_reporting_errors
    sys.exit(run_reporting_errors(main, sys.argv[1:]))
