"""`python -m bench compare`: two runs' metrics.jsonl step by step, and --assert-equal's exit
status naming the first step that differs; `python -m bench against`: a sweep at a commit
extracted beside this tree, its own megalite imported, the two side by side."""
import json
import os

import pytest

import bench.against
from bench.__main__ import COMMANDS
from bench.compare import by_step, compare, differ
from bench.provenance import extract_commit, git, megalite_of
from megalite.cli import dispatch


def run_dir(path, losses, grad_norms=None, evals=()):
    """A run directory whose metrics.jsonl logs these losses from step 1 (and val_loss records)."""
    path.mkdir()
    records = [{"step": i + 1, "loss": loss, "lr": 1e-3, "grad_norm": (grad_norms or losses)[i]}
               for i, loss in enumerate(losses)]
    records += [{"step": step, "val_loss": value} for step, value in evals]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def bench_compare(*argv) -> int:
    return dispatch("python -m bench", COMMANDS, ["compare", *map(str, argv)])


@pytest.mark.unit
def test_equal_runs_pass_assert_equal_and_print_the_table(tmp_path, capsys):
    a = run_dir(tmp_path / "a", [4.0, 3.5, 3.25], evals=[(3, 3.4)])
    b = run_dir(tmp_path / "b", [4.0, 3.5, 3.25], evals=[(3, 3.4)])
    assert bench_compare(a, b / "metrics.jsonl", "--assert-equal") == 0  # a directory or the file
    out = capsys.readouterr().out
    assert "| step | loss A | loss B | loss B-A | grad_norm A | grad_norm B | grad_norm B-A |" in out
    assert "| 2 | 3.5 | 3.5 | 0 | 3.5 | 3.5 | 0 |" in out
    assert "loss: 3 steps in both, largest |B-A| 0" in out and "equal at every step" in out
    assert by_step(a)[3] == {"step": 3, "loss": 3.25, "lr": 1e-3, "grad_norm": 3.25, "val_loss": 3.4}


@pytest.mark.unit
def test_assert_equal_exits_1_naming_the_first_differing_step(tmp_path, capsys):
    a = run_dir(tmp_path / "a", [4.0, 3.5, 3.25, 3.0], grad_norms=[1.0, 0.9, 0.8, 0.7])
    b = run_dir(tmp_path / "b", [4.0, 3.5, 3.26, 3.1], grad_norms=[1.0, 0.91, 0.8, 0.7])
    assert bench_compare(a, b, "--assert-equal") == 1
    out = capsys.readouterr().out
    assert "first differing step: 2 (grad_norm: A 0.9, B 0.91; rtol=0, atol=0)" in out
    assert "loss: 4 steps in both, largest |B-A| 0.1 (step 4)" in out
    # Without --assert-equal the same report exits 0; loss alone first differs at step 3.
    assert bench_compare(a, b, "--metrics", "loss") == 0
    assert "first differing step: 3 (loss: A 3.25, B 3.26" in capsys.readouterr().out
    # Within a tolerance they are equal: |B - A| <= atol + rtol |A|.
    assert bench_compare(a, b, "--assert-equal", "--rtol", "0.04") == 0
    assert bench_compare(a, b, "--assert-equal", "--atol", "0.05") == 1


@pytest.mark.unit
def test_a_step_or_value_in_one_run_only_differs(tmp_path, capsys):
    a = run_dir(tmp_path / "a", [4.0, 3.5, 3.25], evals=[(2, 3.6)])
    b = run_dir(tmp_path / "b", [4.0, 3.5], evals=[(2, 3.6)])
    assert bench_compare(a, b, "--assert-equal", "--metrics", "loss", "val_loss") == 1
    out = capsys.readouterr().out
    assert "| 3 | 3.25 | - | - | - | - | - |" in out  # step 3: no val_loss in either, no loss in B
    assert "first differing step: 3 (loss: A 3.25, B -" in out
    _, first = compare(by_step(a), by_step(b), ["val_loss"])
    assert first is None  # the one evaluation agrees


@pytest.mark.unit
def test_nan_equals_nan_and_differs_from_a_number():
    assert not differ(float("nan"), float("nan")) and differ(1.0, float("nan")) and differ(float("nan"), 1.0)
    assert not differ(None, None) and differ(None, 1.0) and not differ(2.0, 2.0)


@pytest.mark.unit
def test_a_path_without_metrics_is_named(tmp_path, capsys):
    run_dir(tmp_path / "a", [1.0])
    assert bench_compare(tmp_path / "a", tmp_path / "nothing") == 2
    assert "nothing: no metrics.jsonl there" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("metric", ["loss", "tokens_per_s"])
def test_compare_lists_only_steps_with_a_metric(tmp_path, metric):
    a = run_dir(tmp_path / "a", [1.0, 2.0], evals=[(5, 1.5)])
    rows, first = compare(by_step(a), by_step(a), [metric])
    assert [step for step, _ in rows] == ([1, 2] if metric == "loss" else []) and first is None


@pytest.mark.e2e
def test_a_commit_is_extracted_and_its_own_megalite_imported(tmp_path):
    sha = extract_commit("HEAD", tmp_path / "code")
    code = tmp_path / "code"
    assert sha == git("rev-parse", "HEAD") and (code / "configs" / "demo.yaml").is_file()
    env = {**os.environ, "PYTHONPATH": str(code)}
    assert megalite_of(code, env).resolve().parent.parent == code.resolve()
    # A tree whose python imports another megalite (or none) is refused, naming what it found.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(SystemExit, match=f"{elsewhere}: its runs would import megalite from"):
        megalite_of(elsewhere, env)


@pytest.mark.e2e
def test_against_runs_the_sweep_at_both_and_writes_head_over_base(tmp_path, monkeypatch):
    ran = []

    def run_sweep(tree, sweep, out, env):  # each tree's sweep, as its results.json gives it
        ran.append((tree, env.get("MEGALITE_COMMIT")))
        head = tree == bench.against.ROOT
        return [{"point": "0-base", "status": "ok", "step_s": 2.0 if head else 4.0,
                 "peak_memory_gb": 1.0, "device": "cpu"}, {"point": "1-x", "status": "oom"}]
    monkeypatch.setattr(bench.against, "run_sweep", run_sweep)
    out = tmp_path / "out"
    assert dispatch("python -m bench", COMMANDS, ["against", "HEAD", "configs/bench/cpu.yaml",
                                                  "--out", str(out)]) == 0
    sha = git("rev-parse", "HEAD")
    assert ran[0][0] != bench.against.ROOT and ran[0][1] == sha and ran[1] == (bench.against.ROOT, None)
    result = json.loads((out / "comparison.json").read_text())
    assert result["base_commit"] == sha and result["command"].startswith("python -m bench against HEAD")
    ok, oom = result["points"]
    assert ok["step_s"] == {"base": 4.0, "head": 2.0, "head_over_base": 0.5}
    assert oom == {"point": "1-x", "status": {"base": "oom", "head": "oom"}}
