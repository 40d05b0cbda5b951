"""Runs that stop and resume: the resume tests' run (args) and the uninterrupted run it is
compared with, a kill and resume under torchrun, a restart from in-memory snapshots, and the
checks that a resumed run continues the original: bit for bit (assert_continues_exactly), or
from the checkpoint at step SAVED_AT at another layout (resume_and_compare)."""
import re
import signal
import subprocess
import time
from pathlib import Path

import torch

from megalite.training.checkpoint_dirs import latest_checkpoint
from tests.support.checkpoints import read_whole_state
from tests.support.launch import ROOT, kill_every_process_of, run, torchrun
from tests.support.runs import STEPS, common, losses, train_run


def args(cache, run_dir, *extra) -> list[str]:
    return ["-m", "megalite.train"] + common(cache, run_dir, "packed") + [
        "model.dropout=0.1", "train.checkpoint_every=3", "train.micro_batch_size=4",
        "train.eval_every=2", *extra]


def assert_continues_exactly(resumed: Path, whole: Path, after: int) -> None:
    """Every record after step `after` (loss, lr, grad norm, tokens, validation) and the final
    weights are those of the uninterrupted run, bit for bit."""
    for key in ("loss", "lr", "grad_norm", "tokens", "val_loss"):
        expected, got = losses(whole, key), losses(resumed, key)
        assert sorted(got) == sorted(expected), key
        for step in (s for s in expected if s > after):
            assert got[step] == expected[step], (key, step, got[step], expected[step])
    final = f"checkpoints/step_{STEPS:08d}"
    a, b = read_whole_state(whole / final), read_whole_state(resumed / final)
    assert all(torch.equal(a[name], b[name]) for name in a)


def uninterrupted(world: int, cmd_args: list[str]) -> None:
    """A reference run on forked ranks (tests/support/harness.py), not a launch of its own: one thread
    per rank, as torchrun's workers and one_thread() subprocesses have."""
    assert cmd_args[:2] == ["-m", "megalite.train"]
    train_run(world, cmd_args[2:])


def kill_then_resume(cache, whole: Path, killed: Path, *layout: str) -> None:
    """Run on 2 processes, SIGKILL every process once a checkpoint exists, resume: the
    uninterrupted run `whole`'s records and weights, bit for bit."""
    proc = subprocess.Popen(torchrun(2) + args(cache, killed, *layout), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while latest_checkpoint(killed) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    kill_every_process_of(killed)  # agent and workers, as when a node dies
    proc.wait(timeout=60)
    resumed_from = int(latest_checkpoint(killed).name.split("_")[1])
    assert resumed_from < STEPS, "the run finished before it could be killed"

    done = run(torchrun(2) + args(cache, killed, *layout, "train.resume=auto"))
    assert f"step_{resumed_from:08d} at step {resumed_from}" in done.stdout
    assert_continues_exactly(killed, whole, resumed_from)


def snapshot_restart(cache, run_dir: Path, shm: Path, world: int, layout: list[str], fault: str,
                     victim: int) -> str:
    """Train on `world` processes under torchrun --max-restarts 1 with snapshots every 2 steps
    and no disk checkpoint before the end; `fault` (SIGKILL or SIGSTOP) rank `victim` once the
    step-4 snapshot is whole; the output, after checking that the run restarted once from a
    snapshot and finished."""
    import psutil
    cmd = (torchrun(world) + ["--max-restarts", "1"]
           + args(cache, run_dir, *layout, "train.checkpoint_every=0", "train.snapshot_every=2",
                  f"train.snapshot_dir={shm}", "train.watchdog_s=3"))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while len(list(shm.glob("step_00000004.rank_*"))) < world and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children()}
    workers[victim].send_signal(getattr(signal, fault))
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out[-3000:]
    assert latest_checkpoint(run_dir).name == f"step_{STEPS:08d}"  # the only one on disk
    assert not shm.exists()  # cleared, the directory too, once the run ended
    return out


def resumed_step(out: str) -> int:
    resumed = re.findall(r"resumed from the in-memory snapshot of step (\d+)", out)
    assert len(resumed) == 1 and 4 <= int(resumed[0]) < STEPS, out[-3000:]
    return int(resumed[0])


SAVED_AT = 5


def resume_and_compare(cache, original, checkpoint, resumed, world: int, tp: int,
                       extra: tuple[str, ...] = ()) -> None:
    """Train from `checkpoint` at TP=tp (and `extra` settings) on `world` processes: the
    original run's next losses."""
    train_run(world, common(cache, resumed, "padded") + [
        f"parallel.tp={tp}", "train.micro_batch_size=2", f"train.resume={checkpoint}", *extra])
    expected, got = losses(original), losses(resumed)
    assert sorted(got) == list(range(SAVED_AT + 1, STEPS + 1))
    for step in got:
        assert abs(got[step] - expected[step]) <= 1e-5, (tp, step, got[step], expected[step])
