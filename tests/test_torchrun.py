"""README's by-hand command: a layer test under a real torchrun launch (2 CPU processes)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_layer_check_runs_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "-m", "tests.harness", "tests.test_layers:check_linear_layers", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank}: tests.test_layers:check_linear_layers passed" in done.stdout
