"""The failures at run time that end a run with one line per rank (cli.run_reporting_errors),
importable without torch by the command line."""


class CheckpointError(RuntimeError):
    """A save failed on some rank (a full disk, say); every rank raises it together, naming the
    rank and its reason."""


class PeerLost(RuntimeError):
    """A collective failed because a peer died: its message names the rank and the step."""
