"""README's commands, in the order shown, in a fresh directory: the quick start's training, then
every "Common jobs" command this machine can run (not those needing 8 GPUs, several nodes,
Slurm or a GPU), with fewer steps. A command that stops working fails here first."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.nodes import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
# Commands this machine cannot run (8 processes, other nodes, sbatch, long benchmarks).
ELSEWHERE = ("--nproc_per_node 8", "--nnodes", "--submit", "gpu_check.sh", "python -m bench sweep",
             "pip install", "pytest")
STEPS_PER_README_STEP = 1 / 50  # the demo's 150 steps become 3, a resume to 300 becomes 6


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = [text.split("## Quick start")[1].split("```bash")[1].split("```")[0],
              text.split("## Common jobs")[1].split("```bash")[1].split("```")[0]]
    commands = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            for command in line.split("&&"):
                command = " ".join(command.split("#")[0].split())
                if command:
                    commands.append(command)
    return commands


def shortened(command: str) -> list[str]:
    """The command as this test runs it: this Python's torchrun and megalite, fewer steps,
    evaluations and sampled tokens."""
    command = re.sub(r"step_(\d{8})", lambda m: f"step_{round(int(m[1]) * STEPS_PER_README_STEP):08d}",
                     command)
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run", f"--master_port={free_port()}"]
    elif argv[:2] == ["megalite", "torchrun"]:
        argv[:2] = [sys.executable, "-m", "megalite", "torchrun", f"--master_port={free_port()}"]
    elif argv[0] == "megalite":
        argv[:1] = [sys.executable, "-m", "megalite"]
    elif argv[0] == "python":
        argv[0] = sys.executable
    if "megalite.train" in argv:
        steps = next((int(a.split("=")[1]) for a in argv if a.startswith("train.max_steps=")), 150)
        argv += [f"train.max_steps={round(steps * STEPS_PER_README_STEP)}", "sample.max_new_tokens=4",
                 "train.eval_tokens=2048"]
    if "generate" in argv:
        argv += ["--max-new-tokens", "4"]
    return argv


def test_readme_commands_run_in_order_in_a_fresh_directory(tmp_path):
    for shipped in ("bench", "configs", "docs", "megalite"):  # what a clone holds that the commands name
        (tmp_path / shipped).symlink_to(ROOT / shipped)
    ran = []
    for command in readme_commands():
        if any(marker in command for marker in ELSEWHERE):
            continue
        done = subprocess.run(shortened(command), cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        ran.append(command.split(" --")[0])
    # The quick start, prepare + train on it, resume, export, import, eval, generate, dry run,
    # scale model: none silently skipped.
    assert len(ran) == 10, ran
    assert (tmp_path / "runs" / "demo" / "checkpoints" / "step_00000006").is_dir()
    assert (tmp_path / "runs" / "mydata" / "checkpoints" / "step_00000003").is_dir()
    assert not (tmp_path / "runs" / "sweeps").exists()  # the dry run wrote nothing
