"""Where a measurement came from: the commit of the code measured, a commit's code extracted so
that a benchmark runs exactly that commit, and the check that a tree's runs import its own
megalite."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from bench import ROOT


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.rstrip("\n")


def git_commit(tree: Path = ROOT, paths: tuple[str, ...] = ()) -> str:
    """The commit measured, `-dirty` when tracked files (of `paths`, default all) have
    uncommitted changes; MEGALITE_COMMIT where the tree is a copy without .git (as on a lent
    GPU machine)."""
    try:
        sha = git("rev-parse", "HEAD", cwd=tree)
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", *paths, cwd=tree)
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("MEGALITE_COMMIT", "unknown")
    return sha + ("-dirty" if dirty else "")


def cpu_script_header() -> dict:
    """What a CPU benchmark script's results.json opens with: the machine, the date, the commit
    of megalite/ and scripts/ (and whether it had uncommitted changes), the command, torch."""
    import platform
    from datetime import datetime, timezone
    commit = git_commit(paths=("megalite", "scripts"))
    return {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "date": datetime.now(timezone.utc).isoformat(), "commit": commit.removesuffix("-dirty"),
            "dirty": commit.endswith("-dirty"),
            "command": " ".join([Path(sys.executable).name] + sys.argv),
            "torch": __import__("torch").__version__}


def extract_commit(commit: str, root: Path, paths: tuple[str, ...] = ()) -> tuple[str, Path]:
    """`paths` of `commit` (all of it by default), extracted once under `root`:
    (full sha, directory). Written beside and renamed, so a cut run leaves no half tree."""
    sha = git("rev-parse", f"{commit}^{{commit}}")
    dest = root / f"code-{sha[:12]}"
    wanted = " ".join(paths) or "all"  # an extraction of other paths is not this one
    if not ((dest / ".extracted").is_file() and (dest / ".extracted").read_text() == wanted):
        tmp = root / f".code-{sha[:12]}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tar = subprocess.run(["git", "archive", "--format=tar", sha, *paths], cwd=ROOT,
                             check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            archive.extractall(tmp, filter="data")
        (tmp / ".extracted").write_text(wanted)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    return sha, dest


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
