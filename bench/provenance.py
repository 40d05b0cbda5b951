"""Where a measurement came from: the commit of the code measured, a commit's code extracted so
that a benchmark runs exactly that commit, and the check that a tree's runs import its own
megalite."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from bench import ROOT


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.rstrip("\n")


def git_commit(tree: Path = ROOT) -> str:
    """The commit measured, `-dirty` when tracked files have uncommitted changes;
    MEGALITE_COMMIT where the tree is a copy without .git (as on a lent GPU machine)."""
    try:
        sha = git("rev-parse", "HEAD", cwd=tree)
        dirty = git("status", "--porcelain", "--untracked-files=no", cwd=tree)
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("MEGALITE_COMMIT", "unknown")
    return sha + ("-dirty" if dirty else "")


def extract_commit(commit: str, dest: Path) -> str:
    """`commit`'s files (git archive) extracted into the directory `dest`; its full sha."""
    sha = git("rev-parse", f"{commit}^{{commit}}")
    tar = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(dest, filter="data")
    return sha


def megalite_of(tree: Path, env: dict) -> Path:
    """Where a `python` started in `tree` with `env` imports megalite from; it must be `tree`'s
    own, or the benchmark would measure other code than it says."""
    run = subprocess.run([sys.executable, "-c", "import megalite; print(megalite.__file__)"],
                         cwd=tree, env=env, capture_output=True, text=True)
    found = run.stdout.strip()
    if run.returncode or not Path(found).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: its runs would import megalite from "
                         f"{found or (run.stderr.strip().splitlines() or [f'exit {run.returncode}'])[-1]}; "
                         f"give a source tree")
    return Path(found)
