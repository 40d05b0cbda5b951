"""`python -m bench <command> ...` from a clone's root: the measuring tools, outside the
installed package (megalite never imports them; they run megalite)."""
import sys

from megalite.cli import dispatch

# name: (module, function, what it does in one line)
COMMANDS = {
    "sweep": ("bench.runner", "main", "a throughput sweep: tokens/s, MFU, communication"),
    "peer": ("bench.peer", "main", "megalite against Hugging Face transformers"),
    "gpu-check": ("bench.gpu_check", "main", "the GPU tests and benchmarks in one command"),
    "scale-model": ("bench.scaling_cli", "main", "predicted step time of a layout across nodes"),
    "profile-split": ("bench.profile", "main", "committed profiles re-stated: of the unprofiled step"),
    "compare": ("bench.compare", "main", "two runs' losses and gradient norms, step by step"),
    "against": ("bench.against", "main", "a sweep at an earlier commit and at this tree, side by side"),
}

if __name__ == "__main__":
    sys.exit(dispatch("python -m bench", COMMANDS, sys.argv[1:]))
