#!/usr/bin/env bash
# The GPU proof in one command, on a GPU machine's own Python and torch, installing nothing:
#   scripts/gpu_check.sh OUTDIR [--budget-min 7] [--dry-run] [...]   (python -m bench gpu-check --help)
# Where the tree is a copy without .git, set MEGALITE_COMMIT to the commit it is.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$1"
shift
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$root"
exec "${PYTHON:-python3}" -m bench gpu-check --out "$out" "$@"
