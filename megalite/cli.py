"""`megalite <command> ...`: the console script (and `python -m megalite`)."""
from __future__ import annotations

import os
import sys

COMMANDS = {"train": ("megalite.train", "main"),
            "prepare-data": ("megalite.data.prepare", "main"),
            "export": ("megalite.hf.convert", "main_export"),
            "import": ("megalite.hf.convert", "main_import"),
            "eval": ("megalite.evaluate", "main"),
            "generate": ("megalite.generate", "main"),
            "slurm": ("megalite.launch.slurm", "main"),
            "sweep-status": ("megalite.launch.slurm", "main_status"),
            "bench": ("megalite.bench.runner", "main"),
            "peer-bench": ("megalite.bench.peer", "main"),
            "gpu-check": ("megalite.bench.gpu_check", "main"),
            "scale-model": ("megalite.bench.scaling_model", "main")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: megalite {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    module, function = COMMANDS[argv[0]]
    entry = getattr(__import__(module, fromlist=[function]), function)
    return run_reporting_errors(entry, argv[1:])


def run_reporting_errors(entry, argv: list[str]) -> int:
    """Bad input is the user's to fix, not a crash: one line naming the value and the fix,
    from every rank (so it is clear that each one stopped), and exit status 2."""
    from megalite.typed_config import ConfigError
    try:
        return entry(argv)
    except ConfigError as err:
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank is not None else ""
        print(f"megalite: error{where}: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
