"""Checkpoints survive a kill: a resumed run continues the uninterrupted run exactly."""
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from megalite.training.checkpoint_dirs import latest_checkpoint
from tests.support.checkpoints import WeightsOnly, fill_disk_of_rank_0, save_checkpoint
from tests.support.harness import run_distributed
from tests.support.launch import ROOT, one_thread, run, torchrun
from tests.support.resume import args, assert_continues_exactly, resumed_step, snapshot_restart, uninterrupted
from tests.support.runs import STEPS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def whole_tp2(tmp_path_factory, cache):
    """The uninterrupted TP=2 run the interrupted ones are compared with."""
    whole = tmp_path_factory.mktemp("whole") / "run"
    uninterrupted(2, args(cache, whole, "parallel.tp=2"))
    return whole


def test_usr1_to_torchrun_stops_every_rank_with_a_checkpoint_and_resumes_exactly(tmp_path, cache,
                                                                                whole_tp2):
    """Slurm's --signal=USR1 reaches the torchrun agent, which forwards it to its workers. TP=2,
    dropout on: weights, Adam moments, schedule, data position and both RNG streams come back
    from the disk checkpoint. (Every process SIGKILLed, then resumed: test_sharded_checkpoint.py,
    at DP2 with the distributed optimizer.)"""
    stopped = tmp_path / "stopped"
    launcher = torchrun(2) + ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                              "--shutdown-timeout", "60"]
    proc = subprocess.Popen(launcher + args(cache, stopped, "parallel.tp=2"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while latest_checkpoint(stopped) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, out  # stopped early, not finished
    marker = (stopped / "PREEMPTED").read_text()
    step = int(marker.split()[3])
    assert step < STEPS and "on SIGUSR1" in marker, marker
    assert latest_checkpoint(stopped).name == f"step_{step:08d}"  # saved where it stopped

    done = run(torchrun(2) + args(cache, stopped, "parallel.tp=2"))
    assert f"at step {step}" in done.stdout and not (stopped / "PREEMPTED").exists()
    assert_continues_exactly(stopped, whole_tp2, step)


def test_a_hung_rank_restarts_from_the_in_memory_snapshot_bit_for_bit(tmp_path, cache, whole_tp2):
    """TP=2: rank 1 SIGSTOPped once a snapshot exists; rank 0's watchdog finds it within
    train.watchdog_s, kills it and exits; the restarted ranks load the newest snapshot every
    rank has and finish with the uninterrupted run's records and weights, bit for bit. (A rank
    SIGKILLed: tests/test_snapshots.py, at PP2 x EP2.)"""
    out = snapshot_restart(cache, tmp_path / "killed", tmp_path / "shm", 2, ["parallel.tp=2"],
                           "SIGSTOP", victim=1)
    assert re.search(r"megalite: error: rank 0: no step finished in 3 s after step \d+ "
                     r"\(train\.watchdog_s\): rank 1 \(pid \d+ on .*\) hung; killed", out), out[-3000:]
    assert_continues_exactly(tmp_path / "killed", whole_tp2, resumed_step(out))


def test_a_killed_rank_is_named_by_the_survivor_with_the_step(tmp_path, cache):
    """Rank 1 SIGKILLed mid-run: rank 0's collective fails with gloo's words, and rank 0 says
    which rank died, its pid, and during which step, in one line."""
    import psutil
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(torchrun(2) + args(cache, run_dir, "parallel.tp=2"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while latest_checkpoint(run_dir) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children()}
    workers[1].kill()
    err = proc.communicate(timeout=120)[1]
    line = f"megalite: error: rank 0: rank 1 (pid {workers[1].pid}) on "
    said = [x for x in err.splitlines() if x.startswith(line)]
    assert len(said) == 1 and " died during step " in said[0], err[-3000:]
    assert "train.resume=auto" in said[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_stops_a_single_process_run_with_the_preempted_status(tmp_path, cache, sig):
    """Ctrl-C (SIGINT) stops as preemption does: at a step's end, with a checkpoint, no
    traceback."""
    from megalite.training.preemption import PREEMPTED
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable] + args(cache, run_dir), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while latest_checkpoint(run_dir) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == PREEMPTED, err
    marker = (run_dir / "PREEMPTED").read_text()
    assert f"on {sig.name}" in marker and "Traceback" not in err, err
    assert latest_checkpoint(run_dir).name == f"step_{int(marker.split()[3]):08d}"


KILL_DURING_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint.filesystem as dcp_files
original = dcp_files._write_item
def write_then_die(transforms, stream, data, item, *args):
    result = original(transforms, stream, data, item, *args)
    if "step_00000006" in stream.name and item.index.fqn.startswith("optimizer/"):
        stream.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # weights written, the rest and meta.json not yet
    return result
dcp_files._write_item = write_then_die
from megalite.train import main
sys.exit(main(sys.argv[1:]))
"""


def check_save_failing_on_one_rank(tmp):
    """Rank 0's disk is full: every rank raises at once (none waits in a collective) and the
    previous checkpoint stays complete."""
    import megalite.training.checkpoint as checkpoint
    from megalite.model import GPT
    from megalite.parallel.state import ParallelState
    from tests.support.models import CONFIGS
    ps = ParallelState.from_world(2)
    model = GPT(CONFIGS["gpt2"], ps, seed=0)
    save = lambda step: save_checkpoint(tmp, step, model, WeightsOnly(),  # noqa: E731
                                        {"x": torch.zeros(1)}, {}, ps, keep=3)
    save(1)
    fill_disk_of_rank_0(lambda key: True)
    try:
        save(2)
    except checkpoint.CheckpointError as err:
        return str(err), latest_checkpoint(tmp).name
    return "no error", None


def test_a_save_failing_on_one_rank_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    start = time.monotonic()
    (r0, latest0), (r1, latest1) = run_distributed(check_save_failing_on_one_rank, 2, tmp_path,
                                                   timeout=60)
    assert r0 == r1  # each rank says which one failed, and why
    assert re.match(r"writing checkpoint step 2 into '.*\.tmp_step_00000002' failed on rank 0: "
                    r"\[Errno 28\] No space left on device \(the disk is full: [\d.]+ MiB free "
                    r"there; free some space, or give a run\.dir on a disk with room\); the "
                    r"previous checkpoints are intact$", r0), r0
    assert latest0 == latest1 == "step_00000001"
    assert time.monotonic() - start < 45


def test_sigkill_during_checkpoint_write_keeps_the_previous_one(tmp_path, cache):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    uninterrupted(1, args(cache, whole))
    train_args = args(cache, crashed)[2:]
    died = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, *train_args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=one_thread())
    assert died.returncode == -signal.SIGKILL
    half = crashed / "checkpoints" / ".tmp_step_00000006"
    assert list(half.glob("*.distcp")) and not (half / "meta.json").exists()
    assert latest_checkpoint(crashed).name == "step_00000003"

    done = run([sys.executable, "-m", "megalite.train", *train_args, "train.resume=auto"],
               env=one_thread())
    assert "at step 3" in done.stdout
    assert_continues_exactly(crashed, whole, 3)
    assert not half.exists()  # the next save removed the half-written directory


def check_stop_agreement_lags_one_call() -> list[bool]:
    from megalite.parallel.state import ParallelState
    from megalite.training.preemption import StopRequest
    ps = ParallelState.from_world(1)
    stop = StopRequest(signals=())
    seen = [stop.agreed(ps)]
    if dist.get_rank() == 1:  # the signal reaches one rank only
        stop.requested = True
    return seen + [stop.agreed(ps), stop.agreed(ps)]


def test_a_stop_request_on_one_rank_is_agreed_by_all_one_call_later():
    assert run_distributed(check_stop_agreement_lags_one_call, 2) == [[False, False, True]] * 2
