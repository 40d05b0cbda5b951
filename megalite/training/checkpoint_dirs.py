"""Where a run's checkpoints live (RUN_DIR/checkpoints/step_NNNNNNNN, complete once meta.json
is written): found without torch's DCP, which only saving and loading need."""
import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{8})$")


def _step_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if STEP_DIR.match(p.name))


def checkpoint_step(path: Path) -> int:
    return int(STEP_DIR.match(Path(path).name).group(1))


def latest_checkpoint(run_dir: Path) -> Path | None:
    return _newest_complete(Path(run_dir) / "checkpoints")


def _newest_complete(root: Path) -> Path | None:
    return max((p for p in _step_dirs(root) if (p / "meta.json").is_file()), default=None)


def not_a_checkpoint(path: Path) -> str | None:
    """None for a complete checkpoint; else what `path` is and what to give instead: a run
    directory's newest checkpoint, or the import that makes one of a Hugging Face model."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return None
    if not path.exists():
        return f"'{path}' does not exist"
    for root, what in ((path / "checkpoints", "a run directory"), (path, "a directory of checkpoints")):
        if _step_dirs(root):
            newest = _newest_complete(root)
            return (f"'{path}' is {what}, not a checkpoint: " +
                    (f"give its newest checkpoint, '{newest}'" if newest else
                     "it holds no complete checkpoint yet"))
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return (f"'{path}' is a Hugging Face model directory, not a megalite checkpoint: make "
                f"one of it first with `megalite import --from-hf {path} --to CKPT`, then give CKPT")
    return f"'{path}' is not a complete megalite checkpoint (no meta.json)"
