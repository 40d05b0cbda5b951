"""The trainer with pipeline stages: TP2 x PP2 trains the session's TP2 x DP2 model step for step,
its checkpoint resumes without stages, and a rank that dies mid-schedule ends the whole job."""
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.launch import ROOT, torchrun
from tests.support.resume import SAVED_AT, resume_and_compare
from tests.support.runs import assert_same_training, common, train_run

PIPELINE = ["parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=1f1b",
            "train.micro_batch_size=2", "train.checkpoint_every=5"]


@pytest.mark.exactness
def test_tp2xpp2_trains_like_tp2xdp2_and_resumes_without_stages(tmp_path, cache, tp2dp2_padded):
    piped = tmp_path / "tp2xpp2"
    train_run(4, common(cache, piped, "padded") + PIPELINE)
    assert_same_training(tp2dp2_padded, piped)
    checkpoint = piped / "checkpoints" / f"step_{SAVED_AT:08d}"
    for world, tp in ((1, 1), (2, 2)):
        resume_and_compare(cache, piped, checkpoint, tmp_path / f"tp{tp}-resumed", world, tp)


def worker_pid(run_dir: Path, rank: int) -> int:
    """The pid of the worker of global `rank` whose command line names run_dir (torchrun's
    agent names it too, but has no RANK in its environment)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir).encode() in (proc / "cmdline").read_bytes():
                if f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    return int(proc.name)
        except OSError:
            pass
    raise AssertionError(f"no worker of rank {rank} runs {run_dir}")


@pytest.mark.e2e
def test_a_rank_killed_inside_the_schedule_ends_the_job(tmp_path, cache):
    run_dir = tmp_path / "dies"
    cmd = torchrun(2) + ["-m", "megalite.train"] + common(cache, run_dir, "padded") + [
        "parallel.tp=1", "parallel.pp=2", "train.micro_batch_size=2", "train.max_steps=100000",
        "parallel.timeout_minutes=1"]
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()[-3000:]
            time.sleep(0.2)
        os.kill(worker_pid(run_dir, 1), 9)  # the last stage, between or inside schedules
        status = job.wait(timeout=90)  # well inside the 1-minute process-group timeout + exit
        assert status != 0
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=60)
