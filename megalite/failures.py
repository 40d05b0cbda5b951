"""The failures at run time that end a run with one line per rank (cli.run_reporting_errors),
importable by the command line without torch (and without the training package, which
imports the command line's helpers through data/)."""

ERROR_PREFIX = "megalite: error: "  # a command's one line for bad input or a failure (cli.py)


class CheckpointError(RuntimeError):
    """A save failed on some rank (a full disk, say); every rank raises it together, naming the
    rank and its reason."""


class PeerLost(RuntimeError):
    """A collective failed because a peer died: its message names the rank and the step."""
