"""megalite's measuring tools (`python -m bench`, bench/__main__.py): throughput sweeps,
communication accounting, the comparison with transformers, the GPU check and the scaling model.
They live beside the package, not in it: the trainer never imports them."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the clone: bench/ and megalite/ side by side


def on_path(env: dict) -> dict:
    """`env` for a child that runs `-m bench.<tool>` (and megalite, installed or not) from any
    directory: the clone's root first on its path."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
