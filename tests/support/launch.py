"""Launches from the tests: torchrun's command line, a command run to success from the
repository root (run), every process of a run killed, a one-thread environment, what a launch
said (stepped, megalite_lines), and the arguments each command requires."""
import os
import signal
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


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


def one_thread() -> dict[str, str]:
    """The environment of a single-process run compared bit for bit with an uninterrupted()
    one: the thread count can change the order of a sum."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def stepped(run_dir: Path) -> bool:
    """A training step is logged (metrics.jsonl is opened before the first)."""
    log = run_dir / "metrics.jsonl"
    return log.exists() and '"loss"' in log.read_text()


def megalite_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()
            and not line.startswith("W")  # torchrun's start-up banner about OMP_NUM_THREADS
            and not line.startswith("data: rank ")]  # which rank prepares the data


# The arguments each command with a parser in command_args requires.
REQUIRED = {"train": [], "export": ["--ckpt", "C", "--to-hf", "OUT"], "import": ["--from-hf", "D", "--to", "C"],
            "eval": ["--ckpt", "C", "--text", "T"], "generate": ["--ckpt", "C", "--prompt", "P"],
            "slurm": ["S.yaml", "--dry-run"], "sweep-status": ["DIR"]}
