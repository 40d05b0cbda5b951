"""`megalite gpu-check` on CPU: the dry run validates everything the GPU run would launch (so
the command cannot rot between GPU windows), and a real run of a tiny plan writes steps.json
and a summary.md whose numbers are the steps' own JSON."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megalite.bench.gpu_check import PEER_FLAGS, main as gpu_check

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("transformers")


def test_dry_run_plans_and_validates_the_shipped_check(capsys):
    assert gpu_check(["--out", "unused", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = dict(line.split(": ", 1) for line in lines[:-1])
    assert list(steps)[:3] == ["tests-gpu", "tests-train", "bench"]
    assert "tests/test_gpu.py" in steps["tests-gpu"] and "tests/test_gpu_train.py" in steps["tests-train"]
    assert "configs/bench/gpu-check.yaml" in steps["bench"] and "--resume" in steps["bench"]
    expected = [f"peer-{m}-{s}-{b}" for b in ("full", "packed") for m, s in (("gpt2-small", 1024), ("llama-1b", 2048))]
    assert list(steps)[3:] == expected
    for name in expected:
        assert PEER_FLAGS in steps[name] and f"--batch {name.rsplit('-', 1)[1]}" in steps[name]
    assert "--micro-batch 16" in steps["peer-gpt2-small-1024-full"]
    assert "--micro-batch 4" in steps["peer-llama-1b-2048-packed"]
    assert lines[-1] == "gpu-check: 7 steps valid (dry run: nothing launched)"


def _sweep(tmp_path, points, base=ROOT / "configs" / "demo.yaml"):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "base": str(base), "batch": "full",
                                    "overrides": ["parallel.tp=1", "model=tiny"], "warmup_steps": 1,
                                    "steps": 2, "timeout_s": 300, "points": points}))
    return str(path)


TINY = {"model": "tiny", "data.seq_len": 64, "train.micro_batch_size": 2, "train.global_batch_size": 2}


@pytest.mark.parametrize("points, flags, named", [
    ([{**TINY, "parallel.tp": 3}], PEER_FLAGS, "bench: point 0-"),  # n_heads not divisible
    ([{"model": "tiny", "data.seq_len": 64}], PEER_FLAGS, "train.micro_batch_size"),
    ([TINY], "--compile sometimes", "peer-tiny-64-full"),
    ([{**TINY, "model": "no-such-model"}], PEER_FLAGS, "no-such-model"),
])
def test_dry_run_refuses_what_could_not_run(tmp_path, points, flags, named):
    run = subprocess.run([sys.executable, "-m", "megalite", "gpu-check", "--out", str(tmp_path / "out"),
                          "--dry-run", "--skip", "tests", "--sweep", _sweep(tmp_path, points),
                          "--peer-flags", flags], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "megalite: error" in run.stderr and named in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()


def test_a_tiny_check_on_cpu_writes_steps_and_a_summary_of_their_numbers(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--out", str(out), "--skip", "tests", "--sweep", _sweep(tmp_path, [TINY]),
            "--peer-flags", "--warmup 1 --steps 2"]
    assert gpu_check(args) == 0
    state = json.loads((out / "steps.json").read_text())
    assert {k: v["status"] for k, v in state["steps"].items()} == {
        "bench": "ok", "peer-tiny-64-full": "ok", "peer-tiny-64-packed": "ok"}
    assert state["runs"][0]["device"].startswith("cpu") and state["runs"][0]["torch"]
    assert state["runs"][0]["missing_packages"] == []  # this machine has what the steps import
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

    # Run again: the ended steps are kept, not run again.
    capsys.readouterr()
    assert gpu_check(args) == 0
    assert "bench: ok in an earlier run, kept" in capsys.readouterr().out
    assert len(json.loads((out / "steps.json").read_text())["runs"]) == 2


def test_a_step_that_cannot_run_is_recorded_and_the_others_go_on(tmp_path):
    out = tmp_path / "out"
    assert gpu_check(["--out", str(out), "--skip", "tests", "--sweep", _sweep(tmp_path, [TINY]),
                      "--peer-flags", "--compile sometimes"]) == 1
    steps = json.loads((out / "steps.json").read_text())["steps"]
    assert steps["bench"]["status"] == "ok"
    for batch in ("full", "packed"):
        peer = steps[f"peer-tiny-64-{batch}"]
        assert peer["status"] == "failed" and "not launched" in peer["reason"] and "sometimes" in peer["reason"]


def test_a_bench_the_budget_cuts_is_incomplete_and_runs_again(tmp_path, capsys):
    out = tmp_path / "out"
    sweep = _sweep(tmp_path, [TINY, {**TINY, "data.seq_len": 32}])
    # 40 s: the bench step starts with a limit that leaves its sweep a second or so.
    args = ["--out", str(out), "--skip", "tests", "--skip", "peer", "--budget-min", str(40 / 60),
            "--sweep", sweep]
    assert gpu_check(args) == 1
    assert json.loads((out / "steps.json").read_text())["steps"]["bench"]["status"] == "incomplete"
    capsys.readouterr()
    gpu_check(args)
    assert "bench: running" in capsys.readouterr().out  # not kept as ended


def test_a_spent_budget_records_the_steps_not_run(tmp_path):
    out = tmp_path / "out"
    assert gpu_check(["--out", str(out), "--skip", "tests", "--skip", "peer", "--budget-min", "0",
                      "--sweep", _sweep(tmp_path, [TINY])]) == 1
    step = json.loads((out / "steps.json").read_text())["steps"]["bench"]
    assert step["status"] == "not run" and "budget" in step["reason"]
    assert "| bench | not run (the budget of 0.0 min was spent) |" in (out / "summary.md").read_text()
