"""`megalite <command> ...`: the console script (and `python -m megalite`)."""
from __future__ import annotations

import sys

COMMANDS = {"train": "megalite.train"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: megalite {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    module = __import__(COMMANDS[argv[0]], fromlist=["main"])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
