"""Slurm job arrays from YAML sweeps, run on a real one-node Slurm started by the test."""
import io
import json
import os
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from unittest import mock

import pytest
import yaml

from megalite.launch.slurm import main as slurm_main
from megalite.launch.slurm import main_status
from megalite.launch.slurm import render
from megalite.launch.slurm import write_sweep as write_sweep_files
from megalite.launch.sweep import load_sweep
from megalite.typed_config import ConfigError
from tests.support import slurm_cluster
from tests.support.runs import common, losses, train_run

ROOT = Path(__file__).resolve().parent.parent
needs_slurm = pytest.mark.skipif(not slurm_cluster.available(),
                                 reason="needs root and Debian's slurm-wlm + munge (.ci/run installs them)")


def write_sweep(tmp: Path, grid: dict, overrides=(), cache=None, **slurm) -> Path:
    """cache: the runs' data.cache_dir (the session's, for a sweep that trains)."""
    base = tmp / "base.yaml"
    argv = common(str(cache or tmp / "cache"), tmp / "unused", "packed")
    raw = {}
    for item in argv:
        key, value = item.split("=", 1)
        section, *rest = key.split(".")
        if rest:
            raw.setdefault(section, {})[rest[0]] = yaml.safe_load(value)
        else:
            raw[section] = {"preset": value}
    base.write_text(yaml.safe_dump(raw))
    sweep = tmp / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "t", "base": str(base), "run_root": str(tmp / "runs"), "grid": grid,
        "overrides": ["train.micro_batch_size=4", *overrides],
        "slurm": {"nodes": 1, "procs_per_node": 1, "cpus_per_task": 1, "time": "00:10:00",
                  "python": sys.executable, **slurm}}))
    return sweep


@pytest.mark.unit
@pytest.mark.parametrize("grid,slurm,message", [
    ({"train.lrr": [1e-3]}, {}, r"unknown config key 'train\.lrr'; did you mean 'train\.lr'"),
    ({"parallel.tp": [2]}, {"procs_per_node": 3}, r"parallel\.tp=2 must divide the world size 3"),
    ({}, {}, r"has nothing to run: give a non-empty grid"),
    ({"train.lr": []}, {}, r"grid keys \['train\.lr'\] have no values"),
    ({"parallel.pp": [2]}, {"procs_per_node": 3},
     r"not divisible by parallel\.tp x parallel\.pp = 1 x 2"),
    ({"parallel.pp": [4]}, {"procs_per_node": 4}, r"model\.n_layers=2 does not split evenly"),
    ({"parallel.cp": [2]}, {"procs_per_node": 3},
     r"not divisible by parallel\.tp x parallel\.cp = 1 x 2"),
    ({"parallel.cp": [4], "data.seq_len": [36]}, {"procs_per_node": 4},
     r"data\.seq_len=36 with parallel\.cp=4: each row is cut into 2 x parallel\.cp = 8 equal chunks"),
])
def test_bad_sweeps_fail_before_anything_is_written(tmp_path, grid, slurm, message):
    sweep = write_sweep(tmp_path, grid, **slurm)
    with pytest.raises(ConfigError, match=message):
        slurm_main([str(sweep), "--dry-run"])
    assert not (tmp_path / "runs").exists()


@pytest.mark.unit
def test_a_dry_run_prints_the_script_and_writes_nothing(tmp_path, capsys):
    """srun is given --cpus-per-task itself: since Slurm 22.05 it does not inherit #SBATCH's."""
    sweep = write_sweep(tmp_path, {"train.lr": [1e-3, 3e-3]}, cpus_per_task=6, max_restarts=2)
    assert slurm_main([str(sweep), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --cpus-per-task=6\n" in out and "srun --kill-on-bad-exit=1 --cpus-per-task=6 " in out
    assert "--max-restarts 2 " in out  # a dead rank: restarted from the snapshot (megalite torchrun)
    assert "nothing written" in out and "0-lr0.001" in out
    assert not (tmp_path / "runs").exists()


@pytest.mark.unit
def test_a_sweep_over_pipeline_layouts_resolves(tmp_path):
    """parallel.pp and its schedule are sweep keys like any other, checked per point."""
    grid = {"parallel.pp": [1, 2], "parallel.pp_schedule": ["gpipe", "1f1b"]}
    sweep = write_sweep(tmp_path, grid, procs_per_node=2)
    _, runs = load_sweep(sweep)
    assert [(r.config.parallel.pp, r.config.parallel.pp_schedule) for r in runs] == [
        (1, "gpipe"), (1, "1f1b"), (2, "gpipe"), (2, "1f1b")]


@pytest.mark.unit
def test_a_sweep_over_context_parallel_layouts_resolves(tmp_path):
    grid = {"parallel.cp": [1, 2], "parallel.cp_comm": ["all_gather", "p2p"]}
    sweep = write_sweep(tmp_path, grid, procs_per_node=2)
    _, runs = load_sweep(sweep)
    assert [(r.config.parallel.cp, r.config.parallel.cp_comm) for r in runs] == [
        (1, "all_gather"), (1, "p2p"), (2, "all_gather"), (2, "p2p")]


@pytest.mark.unit
def test_missing_base_config_is_named(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "t", "base": "nope.yaml", "grid": {"train.lr": [1]}}))
    with pytest.raises(ConfigError, match=r"sweep\.base 'nope\.yaml' not found"):
        slurm_main([str(sweep), "--dry-run"])


def sweep_status(sweep_dir: Path, env) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "megalite", "sweep-status", str(sweep_dir), "--json"],
                          env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def wait_for(sweep_dir: Path, env, states: set[str], timeout: float = 240) -> list[dict]:
    """`megalite sweep-status`'s rows once every run is in one of `states`. Polled in this
    process: the command imports torch, and run each second it kept a core from the runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = io.StringIO()
        with mock.patch.dict(os.environ, env), redirect_stdout(out):
            assert main_status([str(sweep_dir), "--json"]) == 0
        rows = json.loads(out.getvalue())
        if all(r["state"] in states for r in rows):
            return sweep_status(sweep_dir, env)
        time.sleep(1)
    logs = "".join(p.read_text()[-1500:] for p in (sweep_dir / "logs").glob("*"))
    raise AssertionError(f"sweep did not reach {states}: {rows}\n{logs}")


def submit(sweep: Path, env) -> str:
    done = subprocess.run([sys.executable, "-m", "megalite", "slurm", str(sweep), "--submit"],
                          env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()[2].rstrip(":")


@pytest.mark.e2e
@needs_slurm
def test_an_array_of_two_runs_each_trains_its_own_config(tmp_path, cache):
    sweep = write_sweep(tmp_path, {"train.lr": [1e-3, 1e-2]}, cache=cache)
    with slurm_cluster.slurm_cluster(tmp_path / "slurm") as env:
        submit(sweep, env)
        script = tmp_path / "runs" / "t" / "sweep.sbatch"
        test_only = subprocess.run(["sbatch", "--test-only", str(script)], env=env,
                                   capture_output=True, text=True, timeout=60)
        assert test_only.returncode == 0 and "to start at" in test_only.stderr, test_only.stderr
        rows = wait_for(tmp_path / "runs" / "t", env, {"done", "failed", "OOM", "timeout"})
    assert [r["state"] for r in rows] == ["done"] * 2, rows
    for index, lr in enumerate((1e-3, 1e-2)):
        run_dir = tmp_path / "runs" / "t" / rows[index]["run"]
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["lr"] == lr
        steps = losses(run_dir)
        assert steps[max(steps)] < steps[1] - 0.1
        log = next((tmp_path / "runs" / "t" / "logs").glob(f"*_{index}.out")).read_text()
        assert f"task {index}: {run_dir.resolve() / 'config.yaml'}" in log


@pytest.mark.e2e
@needs_slurm
def test_usr1_under_slurm_checkpoints_requeues_and_resumes_exactly(tmp_path, cache):
    overrides = ["train.max_steps=40", "train.checkpoint_every=5", "model.dropout=0.1"]
    sweep = write_sweep(tmp_path, {"run.seed": [1234]}, overrides, cache=cache)
    with slurm_cluster.slurm_cluster(tmp_path / "slurm") as env:
        # The job's rank on one thread, as the uninterrupted run below in this process: the
        # thread count can change the order of a sum.
        job = submit(sweep, {**env, "OMP_NUM_THREADS": "1"})
        run_dir = next((tmp_path / "runs" / "t").glob("0-*"))
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)
        deadline = time.monotonic() + 120
        while not (run_dir / "PREEMPTED").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (run_dir / "PREEMPTED").exists(), "the run did not stop on USR1"
        rows = wait_for(tmp_path / "runs" / "t", env, {"done", "failed"}, timeout=300)
    assert rows[0]["state"] == "done"
    logs = "".join(p.read_text() for p in (tmp_path / "runs" / "t" / "logs").glob("*.out"))
    assert "preempted: requeueing" in logs and "resumed from" in logs + "".join(
        p.read_text() for p in (tmp_path / "runs" / "t" / "logs").glob("*.err"))

    whole = tmp_path / "whole"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["run"]["dir"] = str(whole)
    (tmp_path / "whole.yaml").write_text(yaml.safe_dump(config))
    train_run(1, ["--config", str(tmp_path / "whole.yaml")])
    assert losses(run_dir) == losses(whole)


@pytest.mark.unit
def test_sweep_paths_are_absolute_so_the_job_finds_its_runs_from_any_directory(tmp_path, monkeypatch):
    sweep = write_sweep(tmp_path, {"train.lr": [1e-3]})
    raw = yaml.safe_load(sweep.read_text())
    raw["run_root"] = "relative/runs"
    sweep.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    written, runs = load_sweep(sweep)
    write_sweep_files(written, runs, render(written, runs, sweep, Path(written.run_root) / "t"))
    listed = (tmp_path / "relative/runs/t/configs.txt").read_text().splitlines()
    config = yaml.safe_load(Path(listed[0]).read_text())
    assert Path(config["run"]["dir"]).is_absolute()
    assert f"#SBATCH --chdir={tmp_path}" in (tmp_path / "relative/runs/t/sweep.sbatch").read_text()


@pytest.mark.unit
def test_a_submitted_task_gone_from_the_queue_unfinished_is_failed(tmp_path):
    from megalite.launch.slurm import run_status
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": 10}}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 5.0, "tokens_per_s": 1.0}) + "\n")
    assert run_status(run_dir, None, queue_answered=True)["state"] == "failed"
    assert run_status(run_dir, "RUNNING", queue_answered=True)["state"] == "running"
    assert run_status(run_dir, None, queue_answered=False)["state"] == "not submitted"
    (tmp_path / "job_id").write_text("7\n")  # submitted, but Slurm did not answer
    assert run_status(run_dir, None, queue_answered=False)["state"] == "unknown"
