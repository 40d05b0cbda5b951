"""`python -m bench gpu-check` on CPU: the dry run validates everything the GPU run would launch (so
the command cannot rot between GPU windows), and a real run of a tiny plan writes steps.json
and a summary.md whose numbers are the steps' own JSON."""
import json
import re
from pathlib import Path

import pytest
import yaml

from bench.gpu_check import PEER_FLAGS, main as gpu_check
from bench.point import compile_label
from bench.runner import load_bench
from megalite.run_config import load_config
from bench.__main__ import COMMANDS
from megalite.cli import dispatch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("transformers")


def test_dry_run_plans_and_validates_the_shipped_check(capsys):
    assert gpu_check(["--out", "unused", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = dict(line.split(": ", 1) for line in lines[:-2])
    assert list(steps)[:7] == ["tests-gpu", "tests-kernels", "tests-train", "bench", "bench-train",
                               "bench-compile", "bench-fp8"]
    assert "tests/test_gpu.py" in steps["tests-gpu"] and "tests/test_gpu_train.py" in steps["tests-train"]
    assert "tests/test_gpu_kernels.py" in steps["tests-kernels"]
    for name, sweep in (("bench", "gpu-check"), ("bench-train", "gpu-train"),
                        ("bench-compile", "gpu-compile"), ("bench-fp8", "gpu-fp8")):
        assert f"configs/bench/{sweep}.yaml" in steps[name] and "--resume" in steps[name]
    expected = [f"peer-{m}-{s}-{b}" for b in ("full", "packed") for m, s in (("gpt2-small", 1024), ("llama-1b", 2048))]
    assert list(steps)[7:] == expected
    for name in expected:
        assert PEER_FLAGS in steps[name] and f"--batch {name.rsplit('-', 1)[1]}" in steps[name]
    assert "--micro-batch 16" in steps["peer-gpt2-small-1024-full"]
    assert "--micro-batch 4" in steps["peer-llama-1b-2048-packed"]
    # The tests and the first two sweeps fit one lease's two calls of the default budget.
    calls = re.fullmatch(r"gpu-check: caps of tests, bench, train ([\d.]+) calls of --budget-min 7; "
                         r"then compile, fp8, peer \d+ min", lines[-2])
    assert calls and float(calls[1]) <= 2, lines[-2]
    assert lines[-1] == "gpu-check: 11 steps valid (dry run: nothing launched)"


def test_the_compile_sweep_sets_each_way_once_on_a_small_and_the_bench_step():
    """torch.compile's default, CUDA graphs (reduce-overhead) at micro-batches 4 and 16, and
    coordinate-descent tuning at 16: each point valid and its settings reaching the config."""
    sweep, points = load_bench(ROOT / "configs" / "bench" / "gpu-compile.yaml")
    assert not [p.error for p in points if p.error]
    ways = []
    for p in points:
        cfg = load_config(str(ROOT / sweep.base), p.overrides)
        assert cfg.train.compile and cfg.model.n_layers == 12 and cfg.data.seq_len == 1024
        ways.append((cfg.train.micro_batch_size, cfg.train.compile_mode,
                     tuple(cfg.train.compile_options.items())))
    assert ways == [(4, "default", ()), (4, "reduce-overhead", ()), (16, "default", ()),
                    (16, "reduce-overhead", ()),
                    (16, "default", (("coordinate_descent_tuning", True),))]
    # The results (and summary.md's compile column) say which way each point compiled.
    labels = [compile_label(load_config(str(ROOT / sweep.base), p.overrides).train) for p in points]
    assert labels == [True, "reduce-overhead", True, "reduce-overhead", "coordinate_descent_tuning=True"]


def test_the_training_shaped_sweep_steps_every_half_million_tokens_in_bf16_and_pure_bf16():
    sweep, points = load_bench(ROOT / "configs" / "bench" / "gpu-train.yaml")
    assert points and not [p.error for p in points if p.error]
    assert {p.settings["train.precision"] for p in points} == {"bf16", "pure_bf16"}
    assert {p.settings["model"] for p in points} == {"gpt2-small", "llama-1b"}
    for p in points:
        cfg = load_config(str(ROOT / sweep.base), p.overrides)
        assert cfg.train.compile and cfg.train.global_batch_size * cfg.data.seq_len == 524_288, p.name
        assert cfg.train.global_batch_size // cfg.train.micro_batch_size >= 16  # accumulation


def _sweep(tmp_path, points, base=ROOT / "configs" / "demo.yaml", name="sweep", grid=None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "base": str(base), "batch": "full",
                                    "overrides": ["parallel.tp=1", "model=tiny"], "warmup_steps": 0,
                                    "steps": 1, "timeout_s": 300, "points": points, "grid": grid or {}}))
    return str(path)


TINY = {"model": "tiny", "data.seq_len": 64, "train.micro_batch_size": 2, "train.global_batch_size": 2}


@pytest.mark.parametrize("points, flags, named", [
    ([{**TINY, "parallel.tp": 3}], PEER_FLAGS, "bench: point 0-"),  # n_heads not divisible
    ([{"model": "tiny", "data.seq_len": 64}], PEER_FLAGS, "train.micro_batch_size"),
    ([TINY], "--compile sometimes", "peer-tiny-64-full"),
    ([{**TINY, "model": "no-such-model"}], PEER_FLAGS, "no-such-model"),
])
def test_dry_run_refuses_what_could_not_run(tmp_path, capsys, points, flags, named):
    # The command line's own entry point, in this process (the exit status and stderr as
    # `python -m bench gpu-check` gives them, without a new interpreter).
    assert dispatch("python -m bench", COMMANDS,
                    ["gpu-check", "--out", str(tmp_path / "out"), "--dry-run", "--skip", "tests",
                     "--sweep", _sweep(tmp_path, points), "--peer-flags", flags]) == 2
    err = capsys.readouterr().err
    assert "megalite: error" in err and named in err, err
    assert not (tmp_path / "out").exists()


def test_a_tiny_check_on_cpu_goes_on_past_a_step_that_cannot_run_and_redoes_it(tmp_path, capsys):
    out = tmp_path / "out"
    fp8 = _sweep(tmp_path, [{**TINY, "train.fp8.layers": "all"}], name="fp8",
                 grid={"train.fp8.recipe": ["none", "tensorwise"]})
    # Training-shaped: 2 micro-batches a step, bf16 weights.
    train = _sweep(tmp_path, [{**TINY, "train.global_batch_size": 4, "train.precision": "pure_bf16"}],
                   name="train")
    # compile: inductor's CPU build would take minutes here (its sweep is checked above).
    args = ["--out", str(out), "--skip", "tests", "--skip", "compile", "--sweep", _sweep(tmp_path, [TINY]),
            "--fp8-sweep", fp8,
            "--train-sweep", train]
    peers = [f"peer-tiny-64-{batch}" for batch in ("full", "packed")]
    # Steps that cannot run are recorded, and the others go on.
    assert gpu_check(args + ["--peer-flags", "--compile sometimes"]) == 1
    steps = json.loads((out / "steps.json").read_text())["steps"]
    assert steps["bench"]["status"] == "ok"
    for name in peers:
        assert steps[name]["status"] == "failed" and "not launched" in steps[name]["reason"] \
            and "sometimes" in steps[name]["reason"]

    # Run again: the ended steps are kept, not run again, but those --redo names.
    capsys.readouterr()
    redo = [arg for name in peers for arg in ("--redo", name)]
    assert gpu_check(args + ["--peer-flags", "--warmup 0 --steps 1", *redo]) == 0
    printed = capsys.readouterr().out
    assert "bench: ok in an earlier run, kept" in printed
    assert all(f"{name}: running" in printed for name in peers)
    state = json.loads((out / "steps.json").read_text())
    assert {k: v["status"] for k, v in state["steps"].items()} == {
        "bench": "ok", "bench-train": "ok", "bench-fp8": "ok", **{n: "ok" for n in peers}}
    assert len(state["runs"]) == 2
    assert state["runs"][-1]["device"].startswith("cpu") and state["runs"][-1]["torch"]
    assert state["runs"][-1]["missing_packages"] == []  # this machine has what the steps import
    summary = (out / "summary.md").read_text()
    bench = json.loads((out / "bench" / "results.json").read_text())["points"][0]
    row = next(line for line in summary.splitlines() if line.startswith(f"| {bench['point']} |"))
    assert f"| {bench['tokens_per_s']:,.0f} |" in row and row.endswith("| ok |")
    for batch in ("full", "packed"):
        result = json.loads((out / f"peer-tiny-64-{batch}.json").read_text())
        assert result["batch"] == batch and result["cuda"] == __import__("torch").version.cuda
        for r in result["rows"]:
            line = next(line for line in summary.splitlines()
                        if re.match(rf"\| tiny \| 64 \| {batch} \| False \| {r['system']} \|", line))
            assert f"| {r['tokens_per_s']:,.0f} |" in line
    assert "Not run (--skip tests)" in summary
    shaped = json.loads((out / "bench-train" / "results.json").read_text())["points"][0]
    row = next(line for line in summary.splitlines() if line.startswith(f"| {shaped['point']} |"))
    assert "| 2 | 4 | pure_bf16 |" in row and f"| {shaped['tokens_per_s']:,.0f} |" in row
    bf16, fp8 = json.loads((out / "bench-fp8" / "results.json").read_text())["points"]
    assert bf16["fp8"] is None and fp8["fp8"] == "tensorwise" and fp8["fp8_layers"] > 0
    row = next(line for line in summary.splitlines() if line.startswith(f"| {fp8['point']} |"))
    assert f"| tensorwise ({fp8['fp8_layers']}) |" in row
    assert f"| {fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f} |" in row


def test_a_bench_the_budget_cuts_is_incomplete_and_not_kept(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--out", str(out), "--skip", "tests", "--skip", "peer", "--skip", "fp8", "--skip", "train",
            "--skip", "compile",
            "--sweep", _sweep(tmp_path, [TINY, {**TINY, "data.seq_len": 32}])]
    # 40 s: the bench step starts with a limit that leaves its sweep a second or so.
    assert gpu_check(args + ["--budget-min", str(40 / 60)]) == 1
    assert json.loads((out / "steps.json").read_text())["steps"]["bench"]["status"] == "incomplete"
    # Run again: not kept as ended, the step is due; the budget spent, it is recorded as not run.
    capsys.readouterr()
    assert gpu_check(args + ["--budget-min", "0"]) == 1
    assert "kept" not in capsys.readouterr().out
    step = json.loads((out / "steps.json").read_text())["steps"]["bench"]
    assert step["status"] == "not run" and "budget" in step["reason"]
    assert "| bench | not run (the budget of 0.0 min was spent) |" in (out / "summary.md").read_text()
