"""Checkpoints survive a kill: a resumed run continues the uninterrupted run exactly."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalite.training.checkpoint import latest_checkpoint
from tests.test_train import STEPS, common, losses

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data-cache"))


def args(cache, run_dir, *extra) -> list[str]:
    return ["-m", "megalite.train"] + common(cache, run_dir, "packed") + [
        "model.dropout=0.1", "train.checkpoint_every=3", "train.micro_batch_size=4", *extra]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def kill_every_process_of(run_dir: Path) -> None:
    """SIGKILL every process whose command line names run_dir: torchrun starts its workers in
    sessions of their own, so killing the agent's process group would leave them running."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir).encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def test_sigkill_then_resume_continues_exactly(tmp_path, cache):
    """TP=2, dropout on: weights, Adam moments, schedule, data position and both RNG streams."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    run(torchrun(2) + args(cache, whole, "parallel.tp=2"))
    proc = subprocess.Popen(torchrun(2) + args(cache, killed, "parallel.tp=2"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while latest_checkpoint(killed) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    kill_every_process_of(killed)  # agent and workers, as when a node dies
    proc.wait()
    resumed_from = int(latest_checkpoint(killed).name.split("_")[1])
    assert resumed_from < STEPS, "the run finished before it could be killed"

    done = run(torchrun(2) + args(cache, killed, "parallel.tp=2", "train.resume=auto"))
    assert f"step_{resumed_from:08d} at step {resumed_from}" in done.stdout
    expected, got = losses(whole), losses(killed)
    assert sorted(got) == sorted(expected)
    for step in range(resumed_from + 1, STEPS + 1):
        assert got[step] == expected[step], (step, got[step], expected[step])


KILL_DURING_SAVE = """
import os, signal, sys
import megalite.training.checkpoint as checkpoint
original = checkpoint.save_file
def save_then_die(tensors, path):
    original(tensors, path)
    if path.endswith("step_00000006/model.safetensors"):
        os.kill(os.getpid(), signal.SIGKILL)  # model written, optimizer and meta not yet
checkpoint.save_file = save_then_die
from megalite.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_during_checkpoint_write_keeps_the_previous_one(tmp_path, cache):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    run([sys.executable] + args(cache, whole))
    train_args = args(cache, crashed)[2:]
    died = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, *train_args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert died.returncode == -signal.SIGKILL
    half = crashed / "checkpoints" / ".tmp_step_00000006"
    assert (half / "model.safetensors").is_file() and not (half / "meta.json").exists()
    assert latest_checkpoint(crashed).name == "step_00000003"

    done = run([sys.executable, "-m", "megalite.train", *train_args, "train.resume=auto"])
    assert "at step 3" in done.stdout
    expected, got = losses(whole), losses(crashed)
    for step in range(4, STEPS + 1):
        assert got[step] == expected[step], (step, got[step], expected[step])
    assert not half.exists()  # the next save of step 6 replaced the half-written directory
