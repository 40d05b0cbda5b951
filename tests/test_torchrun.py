"""Real torchrun launches (2 CPU processes): README's by-hand command, and bad input under
torchrun and under `megalite torchrun` (docs/training.md: what each prints, its exit status)."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
LAUNCHERS = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
             "megalite torchrun": [sys.executable, "-m", "megalite", "torchrun"]}


def launch(launcher: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCHERS[launcher], "--nproc_per_node", "2", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


def test_layer_check_runs_under_torchrun():
    done = launch("torchrun", "-m", "tests.support.harness", "tests.test_layers:check_linear_layers", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank}: tests.test_layers:check_linear_layers passed" in done.stdout


BAD_CONFIG = ("-m", "megalite.train", "--config", "configs/demo.yaml", "parallel.tp=3")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "megalite: error" in line]


def test_bad_input_under_torchrun_is_one_line_and_torchruns_report_names_it():
    done = launch("torchrun", *BAD_CONFIG)
    assert done.returncode == 1, done.stderr  # torchrun's, for any worker that failed
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and "parallel.tp=3" in lines[0], done.stderr
    root_cause = done.stderr.split("Root Cause")[1]
    # The rank torchrun observed first exited 2, or was still writing its error when torchrun
    # stopped it (SIGTERM): either way its error file holds the ConfigError.
    assert ("exitcode  : 2" in root_cause or "(SIGTERM)" in root_cause) and \
        "traceback : ConfigError: " in root_cause, root_cause


def test_bad_input_under_megalite_torchrun_is_one_line_and_exit_status_2():
    done = launch("megalite torchrun", *BAD_CONFIG)
    assert done.returncode == 2, done.stderr
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("megalite: error: ") and "parallel.tp=3" in lines[0]
    for noise in ("Traceback", "FAILED", "closing signal", "exitcode"):
        assert noise not in done.stderr, done.stderr
