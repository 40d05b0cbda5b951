"""Ctrl-C ends a run as docs/training.md says, through `megalite torchrun` and alone: the first
stops every rank after a step with a checkpoint, one line and exit status 3; a second one stops
at once, unsaved, one line and 130. (torchrun's agent gets the terminal's SIGINT, its workers
being in sessions of their own: it passes the first on as SIGINT, the second as SIGTERM.)"""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalite.cli import INTERRUPTED
from megalite.training.checkpoint_dirs import latest_checkpoint
from megalite.training.preemption import PREEMPTED
from tests.support.launch import megalite_lines, stepped

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
MEGALITE_TORCHRUN = [sys.executable, "-m", "megalite", "torchrun", "--nproc_per_node", "2"]
HINT = ("megalite: Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop at "
        "once, unsaved)")


def train_args(cache: str, run_dir: Path, slow: bool) -> list[str]:
    # slow: steps of a second or more, so that the second Ctrl-C comes before the first's stop.
    model = (["model.hidden=256", "model.n_layers=6", "model.max_seq_len=256", "data.seq_len=256"]
             if slow else ["model.hidden=32", "data.seq_len=32"])
    return ["-m", "megalite.train", "model=tiny", *model, "data.bpe_vocab_size=512",
            f"data.cache_dir={cache}", "train.max_steps=1000", "train.global_batch_size=8",
            "train.checkpoint_every=1000", "train.eval_tokens=256", f"run.dir={run_dir}"]


def interrupt(cmd: list[str], run_dir: Path, times: int) -> subprocess.CompletedProcess:
    """Start `cmd`, send it SIGINT `times` times (0.3 s apart) once a step is logged."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not stepped(run_dir) and proc.poll() is None:
            assert time.monotonic() < deadline, "no step logged in 240 s"
            time.sleep(0.05)
        for i in range(times):
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_ctrl_c_under_megalite_torchrun_stops_with_a_checkpoint_and_status_3(tmp_path, cache):
    run_dir = tmp_path / "run"
    done = interrupt(MEGALITE_TORCHRUN + train_args(cache, run_dir, slow=False), run_dir, 1)
    assert done.returncode == PREEMPTED, done.stderr[-3000:]
    assert megalite_lines(done.stderr) == [HINT], done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    step = latest_checkpoint(run_dir).name.removeprefix("step_").lstrip("0")
    assert last == (f"stopped after step {step} on SIGINT with a checkpoint; resume with "
                    f"train.resume=auto (run.dir={run_dir})"), done.stdout[-2000:]
    assert (run_dir / "PREEMPTED").read_text() == last + "\n"


def test_a_second_ctrl_c_under_megalite_torchrun_stops_at_once_unsaved_with_130(tmp_path, cache):
    run_dir = tmp_path / "run"
    done = interrupt(MEGALITE_TORCHRUN + train_args(cache, run_dir, slow=True), run_dir, 2)
    assert done.returncode == INTERRUPTED, done.stderr[-3000:]
    assert megalite_lines(done.stderr) == [HINT, "megalite: interrupted: stopped at once, unsaved; "
                                           "train.resume=auto resumes from the last checkpoint"]
    assert latest_checkpoint(run_dir) is None and not (run_dir / "PREEMPTED").exists()


def test_a_second_ctrl_c_stops_a_single_process_at_once_with_130(tmp_path, cache):
    run_dir = tmp_path / "run"
    done = interrupt([sys.executable] + train_args(cache, run_dir, slow=True), run_dir, 2)
    assert done.returncode == INTERRUPTED, done.stderr[-3000:]
    assert megalite_lines(done.stderr)[-2:] == [HINT, "megalite: interrupted: stopped at once, "
                                                "unsaved; train.resume=auto resumes from the last "
                                                "checkpoint"]
    assert latest_checkpoint(run_dir) is None


SIGNALS_AFTER = """import os, signal, sys, time
from megalite.training.preemption import StopRequest, the_stop_is_saved
with StopRequest() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # the handler runs between bytecodes
    if sys.argv[1] == "saved":
        the_stop_is_saved(stop, 0)
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's agent passes the second Ctrl-C on so
    time.sleep(5)
sys.exit(0)
"""


def test_a_signal_after_the_stops_checkpoint_ends_the_rank_as_stopped():
    """A second Ctrl-C that comes once the stop's checkpoint is whole: status 3 and not the
    'unsaved' line; before it, 130 and that line."""
    runs = {when: subprocess.run([sys.executable, "-c", SIGNALS_AFTER, when], cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
            for when in ("saved", "unsaved")}
    assert runs["saved"].returncode == PREEMPTED and "interrupted" not in runs["saved"].stderr
    assert runs["unsaved"].returncode == INTERRUPTED
    assert runs["unsaved"].stderr.strip().endswith("megalite: interrupted: stopped at once, "
                                                   "unsaved; train.resume=auto resumes from the "
                                                   "last checkpoint")


def test_ranks_killed_before_their_stop_is_saved_are_one_line(tmp_path, cache):
    """torchrun kills the ranks that have not stopped within --shutdown-timeout (here at once):
    megalite torchrun says so, with the fix, instead of ending in silence."""
    run_dir = tmp_path / "run"
    cmd = MEGALITE_TORCHRUN + ["--shutdown-timeout", "0"] + train_args(cache, run_dir, slow=True)
    done = interrupt(cmd, run_dir, 1)
    assert done.returncode == INTERRUPTED, done.stderr[-3000:]
    assert megalite_lines(done.stderr)[-1].startswith(
        "megalite: error: the ranks did not stop with their checkpoint in torchrun's "
        "--shutdown-timeout"), done.stderr[-3000:]
