"""`megalite <command> ...`: the console script (and `python -m megalite`)."""
import difflib
import json
import os
import sys
import time

from megalite.command_args import PARSERS
from megalite.failures import ERROR_PREFIX, CheckpointError, PeerLost
from megalite.typed_config import ConfigError

# name: (module, function, what it does in one line)
COMMANDS = {
    "train": ("megalite.train", "main", "train a model: alone, or on every rank under torchrun"),
    "torchrun": ("megalite.launch.torchrun", "main",
                 "torchrun, with one line and exit status 2 for bad input (torchrun's arguments)"),
    "prepare-data": ("megalite.prep.command", "main",
                     "tokenize raw files (jsonl, parquet, txt) into Megatron .bin/.idx shards"),
    "export": ("megalite.hf.convert", "main_export", "write a checkpoint as a Hugging Face model"),
    "import": ("megalite.hf.convert", "main_import", "make a checkpoint of a Hugging Face model"),
    "eval": ("megalite.evaluate", "main", "the loss and perplexity of a checkpoint on a text file"),
    "generate": ("megalite.generate", "main", "sample text from a checkpoint (KV cache, TP, PP)"),
    "slurm": ("megalite.launch.slurm", "main", "a YAML sweep as a Slurm job array: print or submit"),
    "sweep-status": ("megalite.launch.slurm", "main_status", "the state of a submitted sweep's runs"),
}
# The commands that compute in their own process (alone, or one rank of a torchrun launch): see
# cap_threads. Not torchrun itself: its workers inherit its OMP_NUM_THREADS.
# Not train: its numbers must not depend on the load (command_args.TRAIN_THREADS).
COMPUTING = ("export", "import", "eval", "generate")
# Commands that left the package with the measuring tools: their name under `python -m bench`.
MOVED = {"bench": "sweep", "peer-bench": "peer", "gpu-check": "gpu-check", "scale-model": "scale-model"}
USAGE = 2  # the exit status of bad input, as argparse's
INTERRUPTED = 130  # a shell's status for a process Ctrl-C stopped (128 + SIGINT)
# Set by `megalite torchrun` for its workers: the directory where a rank leaves its error line.
ERROR_DIR = "MEGALITE_ERROR_DIR"
STOPPED = "stopped."  # + rank: a rank's mark there that it stopped on request with a checkpoint
# How long a rank other than 0 waits before printing its error: rank 0 meets the same checks
# and prints it, and torchrun then stops this rank before it prints the same line again.
QUIET_RANK_GRACE_S = 5.0


def main(argv: list[str] | None = None) -> int:
    return dispatch("megalite", COMMANDS, sys.argv[1:] if argv is None else argv, MOVED, PARSERS, COMPUTING)


def dispatch(prog: str, commands: dict, argv: list[str], moved: dict | None = None,
             parsers: dict | None = None, computing: tuple[str, ...] = ()) -> int:
    """Run `prog <command> ...` from a table like COMMANDS (also the measuring tools' table).
    parsers: {command: its parser's maker}, for commands whose module is slow to import;
    computing: the commands whose torch threads cap_threads sets."""
    first = argv[0] if argv else None
    if moved and first in moved:
        print(f"{prog}: '{first}' moved out of the package with the measuring tools: from a "
              f"clone's root, run `python -m bench {moved[first]}`", file=sys.stderr)
        return USAGE
    if first in ("-h", "--help"):
        print(overview(prog, commands))
        return 0
    if first == "--version":
        from importlib.metadata import PackageNotFoundError, version
        try:
            print(f"megalite {version('megalite')}")
        except PackageNotFoundError:
            print("megalite (not installed: run from a source tree)")
        return 0
    if first not in commands:
        if first is not None:
            near = difflib.get_close_matches(first, commands, n=1)
            print(f"{prog}: unknown command '{first}'" + (f" (did you mean '{near[0]}'?)" if near else ""),
                  file=sys.stderr)
        print(overview(prog, commands), file=sys.stderr)
        return USAGE
    if parsers and first in parsers:
        parsers[first]().parse_args(argv[1:])  # --help and bad arguments: before torch loads
    if first in computing:
        cap_threads()
    module, function, _ = commands[first]
    entry = getattr(__import__(module, fromlist=[function]), function)
    return run_reporting_errors(entry, argv[1:])


def cap_threads() -> None:
    """torch's CPU threads, set before torch is imported (it reads OMP_NUM_THREADS then): the
    user's OMP_NUM_THREADS (or torchrun's, 1 per rank) where set, else the cores this process
    may use that other processes leave idle. torch's own default, every core, is slow on a
    busy machine, each op waiting for its thread that shares a core: a one-process eval of 400
    conversations on a loaded machine ran 2.8x faster with OMP_NUM_THREADS=1."""
    if "OMP_NUM_THREADS" in os.environ or "torch" in sys.modules:
        return  # the user's; or torch is running already (a call from Python, e.g. a test)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(torch_threads(cores, os.getloadavg()[0]))


def torch_threads(cores: int, load: float) -> int:
    """The cores left over by `load` runnable processes (the 1-minute load average), at least 1."""
    return max(1, round(cores - load))


def overview(prog: str, commands: dict) -> str:
    width = max(map(len, commands)) + 2
    lines = [f"usage: {prog} <command> [options]    ({prog} <command> --help: its options)",
             "", "commands:"]
    lines += [f"  {name.ljust(width)}{what}" for name, (_, _, what) in commands.items()]
    lines += ["", "options:", f"  {'-h, --help'.ljust(width)}this list",
              f"  {'--version'.ljust(width)}megalite's version"]
    return "\n".join(lines)


def run_reporting_errors(entry, argv: list[str]) -> int:
    """Bad input is the user's to fix, not a crash: one line naming the value and the fix, and
    exit status 2. Every rank meets the same checks before any collective, so one rank's line
    says it for all (see report_error)."""
    try:
        return entry(argv)
    except (ConfigError, CheckpointError) as err:  # CheckpointError: every rank, the failing one's reason
        status = USAGE if isinstance(err, ConfigError) else 1
        report_error(str(err), status)
        return status
    except PeerLost as err:  # every surviving rank says it: the dead one may be rank 0
        line = f"{ERROR_PREFIX}rank {os.environ.get('RANK', '0')}: {err}"
        # torchrun restarts the ranks (while --max-restarts allows) without a report, and so
        # without the launcher's line.
        restarts_left = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < \
            int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        # Printed before it is left for the launcher: once the line is there, the agent stops
        # this rank (SIGTERM, this run's handler gone by now) before a print after it.
        if restarts_left or ERROR_DIR not in os.environ:
            print(line, file=sys.stderr, flush=True)
        leave_for_launcher(line, 1)
        return 1
    except KeyboardInterrupt:  # Ctrl-C where no run handles it (a run: training/preemption.py)
        if os.environ.get("RANK", "0") == "0":
            print("megalite: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED


def report_error(message: str, status: int = USAGE) -> None:
    """`megalite: error: ...` on stderr, once for the whole launch.

    Under `megalite torchrun` the rank leaves it in the launcher's directory, and the launcher
    prints the first. Under torchrun it also goes to the rank's TORCHELASTIC_ERROR_FILE, so
    torchrun's failure report names it; rank 0 prints it, and any other rank only if it is
    still running QUIET_RANK_GRACE_S later (rank 0 did not stop on it)."""
    line = f"{ERROR_PREFIX}{message}"
    if leave_for_launcher(line, status):
        return
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # the format torchelastic's ErrorHandler writes and its report reads
        with open(error_file, "w") as f:
            json.dump({"message": {"message": f"ConfigError: {message}",
                                   "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    if os.environ.get("RANK", "0") != "0":
        time.sleep(QUIET_RANK_GRACE_S)
    print(line, file=sys.stderr, flush=True)


def _launcher_file(name: str) -> str | None:
    """Under `megalite torchrun`: the path of `name` in the launcher's directory, else None."""
    launcher_dir = os.environ.get(ERROR_DIR)
    return os.path.join(launcher_dir, name) if launcher_dir else None


def leave_for_launcher(line: str, status: int) -> bool:
    """Under `megalite torchrun`: the rank's line and exit status, in the launcher's directory
    under the rank's number (which also tells peers.Peers that this rank ended on its own)."""
    path = _launcher_file(os.environ.get("RANK", "0"))
    if path is None:
        return False
    with open(path + ".tmp", "w") as f:
        f.write(f"{status} {line}")
    os.replace(path + ".tmp", path)  # the launcher never reads half
    return True


def left_a_line(rank: int) -> bool:
    """Under `megalite torchrun`: whether rank `rank` left its line (leave_for_launcher)."""
    path = _launcher_file(str(rank))
    return path is not None and os.path.exists(path)


def mark_stopped(rank: int) -> None:
    """Under `megalite torchrun`: this rank stopped on request with a checkpoint."""
    if (path := _launcher_file(f"{STOPPED}{rank}")) is not None:
        open(path, "w").close()


def forget_left(rank: int) -> None:
    """A rank's lines of an earlier round of a restarted launch: gone before it meets its
    peers, so that they are neither printed for this round nor taken as ended ranks."""
    for name in (str(rank), f"{STOPPED}{rank}"):
        if (path := _launcher_file(name)) is not None and os.path.exists(path):
            os.remove(path)


if __name__ == "__main__":
    sys.exit(main())
