"""A rank killed mid-run at TP2 x DP2: every survivor names it (not the survivors that stopped
before it: training/peers.py), and `megalite torchrun` says so in one line with exit status 1,
without its own traceback or torchrun's report of the failed ranks."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import psutil
from tests.support.launch import megalite_lines, stepped

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


LAUNCHERS = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
             "megalite torchrun": [sys.executable, "-m", "megalite", "torchrun"]}


def kill_rank(launcher: str, cache: str, run_dir: Path, victim: int, **env: str):
    """Train on 4 ranks, SIGKILL rank `victim` once a step is logged: (exit status, stderr,
    the victim's pid)."""
    cmd = LAUNCHERS[launcher] + [
        "--nproc_per_node", "4", "-m", "megalite.train", "model=tiny", "model.hidden=32",
        "data.seq_len=32", "data.bpe_vocab_size=512", f"data.cache_dir={cache}",
        "train.max_steps=1000", "train.global_batch_size=8", "train.checkpoint_every=1000",
        "parallel.tp=2", f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 240
        while not stepped(run_dir) and proc.poll() is None:
            assert time.monotonic() < deadline, "no step logged in 240 s"
            time.sleep(0.05)
        workers = {int(p.environ()["RANK"]): p for p in psutil.Process(proc.pid).children()}
        workers[victim].kill()
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    return proc.returncode, err, workers[victim].pid


def test_every_survivor_names_the_rank_that_died_first(tmp_path, cache):
    """Each survivor's line, as it leaves it for `megalite torchrun` (in the directory the
    launcher names), names rank 1, also those of ranks that failed after rank 0 had ended."""
    said = tmp_path / "said"
    said.mkdir()
    status, err, pid = kill_rank("torchrun", cache, tmp_path / "run", 1, MEGALITE_ERROR_DIR=str(said))
    assert status == 1
    lines = {int(p.name): p.read_text() for p in said.iterdir() if p.name.isdigit()}
    assert sorted(lines) == [0, 2, 3], err[-3000:]
    for rank, line in lines.items():
        assert line.startswith(f"1 megalite: error: rank {rank}: rank 1 (pid {pid}) on "), line
        assert " died during step " in line and line.endswith("(train.resume=auto)"), line


def test_a_dead_rank_under_megalite_torchrun_is_one_line_and_status_1(tmp_path, cache):
    status, err, pid = kill_rank("megalite torchrun", cache, tmp_path / "run", 2)
    assert status == 1, err[-3000:]
    lines = megalite_lines(err)
    assert len(lines) == 1 and lines[0].startswith("megalite: error: rank ") \
        and f": rank 2 (pid {pid}) on " in lines[0], err[-3000:]
    for noise in ("Traceback", "ChildFailedError", "FAILED", "closing signal", "exitcode"):
        assert noise not in err, err[-3000:]


def ranks(proc: subprocess.Popen, gone: list[int]) -> dict:
    """The launcher's live workers by rank, but pids in `gone` (a zombie has no environment)."""
    found = {}
    for child in psutil.Process(proc.pid).children():
        try:
            if child.pid not in gone and child.status() != psutil.STATUS_ZOMBIE:
                found[int(child.environ()["RANK"])] = child
        except (psutil.NoSuchProcess, psutil.ZombieProcess, KeyError):
            pass
    return found


def last_step(run_dir: Path) -> int:
    log = run_dir / "metrics.jsonl"
    steps = [json.loads(line).get("step", 0) for line in log.read_text().splitlines()] if log.exists() else []
    return max(steps, default=0)


def test_a_restarted_launch_says_each_death_and_names_the_last_rightly(tmp_path, cache):
    """megalite torchrun --max-restarts 1 on 2 ranks: rank 1 killed, rank 0 says so itself
    (torchrun restarts the ranks without a report, so the launcher prints nothing); the new
    round's rank 0 killed, rank 1 names rank 0 (not taken for a rank that ended on its own by
    the line it left in the round before), and the launch ends with that one line."""
    run_dir = tmp_path / "run"
    cmd = LAUNCHERS["megalite torchrun"] + [
        "--nproc_per_node", "2", "--max-restarts", "1", "-m", "megalite.train", "model=tiny",
        "model.hidden=32", "data.seq_len=32", "data.bpe_vocab_size=512", f"data.cache_dir={cache}",
        "train.max_steps=1000", "train.global_batch_size=8", "train.checkpoint_every=2",
        "parallel.tp=2", f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = []
    try:
        for victim in (1, 0):
            deadline, after = time.monotonic() + 240, last_step(run_dir)
            workers = {}
            while proc.poll() is None and not (last_step(run_dir) > after + 2 and len(workers) == 2):
                assert time.monotonic() < deadline, "no new step logged in 240 s"
                time.sleep(0.05)
                workers = ranks(proc, killed)
            workers[victim].kill()
            killed.append(workers[victim].pid)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("megalite: ")]
    assert len(lines) == 2, err[-3000:]
    assert lines[0].startswith(f"megalite: error: rank 0: rank 1 (pid {killed[0]}) on "), lines
    assert lines[1].startswith(f"megalite: error: rank 1: rank 0 (pid {killed[1]}) on "), lines
    for noise in ("Traceback", "ChildFailedError", "exitcode"):
        assert noise not in err, err[-3000:]
