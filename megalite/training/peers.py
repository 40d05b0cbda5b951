"""Naming the rank that died. When a rank is killed, its peers' next collective fails with the
transport's words (gloo: "Connection closed by peer"), which name no rank; the launcher's report
comes later, under its own. So the ranks swap (host, pid) at start, and a rank whose collective
fails looks up which peers on its own host are gone (no process, or a zombie not yet reaped)
and says so in one line with the step; where none is within a second, the dead rank was on
another node.
"""
import os
import socket
import time
from pathlib import Path

from megalite.parallel.state import ParallelState
from megalite.cli import forget_left, left_a_line
from megalite.failures import PeerLost


class Peers:
    def __init__(self, pstate: ParallelState):
        """A collective over the world: every rank's (host, pid)."""
        forget_left(pstate.rank)  # before the exchange: no peer looks before it is done
        self.host = socket.gethostname()
        self.table: list[tuple[str, int]] = pstate.gather_over_ranks((self.host, os.getpid()))
        self.step: int | None = None  # the step being trained (set by the loop), None: before

    def gone(self) -> list[int]:
        """The ranks on this host whose process has ended, but those that ended on their own
        after a peer died (under `megalite torchrun` they left their line in the launcher's
        directory first): a late survivor names the rank that died first, not the survivors
        that stopped before it."""
        # Ended: no process, or a zombie (Z, X) not yet reaped.
        return [rank for rank, (host, pid) in enumerate(self.table)
                if host == self.host and process_state(pid) in (None, "Z", "X") and not left_a_line(rank)]

    def lost(self, err: BaseException) -> PeerLost | None:
        """A PeerLost for `err`, a failed collective, where a peer has died; None if none has
        (and the failure is not a lost peer's: a transport that reports one names it)."""
        if len(self.table) == 1:
            return None
        where = f"step {self.step}" if self.step is not None else "start-up, before the first step"
        dead = self.gone()
        if not dead and _peer_words(err):
            # A killed process closes its sockets before /proc shows it ended: a moment for it.
            deadline = time.monotonic() + SETTLE_S
            while not dead and time.monotonic() < deadline:
                time.sleep(0.02)
                dead = self.gone()
        if dead:
            who = ", ".join(f"rank {r} (pid {self.table[r][1]})" for r in dead)
            return PeerLost(f"{who} on {self.host} died during {where}{THEN}")
        if not _peer_words(err):
            return None
        return PeerLost(f"a peer on another node died during {where} (this node's ranks are "
                        f"alive; the launcher's report names it){THEN}")


SETTLE_S = 1.0


THEN = (": this rank stops too; the newest in-memory snapshot or checkpoint resumes the run "
        "(train.resume=auto)")


def process_state(pid: int) -> str | None:
    """The process's state letter (R running, S sleeping, T stopped, Z zombie...), None if it
    is gone; on a system without /proc, R for any live process."""
    if Path("/proc/self/stat").exists():  # Linux: a zombie still answers os.kill
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "R"


def _peer_words(err: BaseException) -> bool:
    """How gloo and NCCL say a peer went away."""
    text = str(err)
    return any(words in text for words in ("Connection closed by peer", "Connection reset by peer",
                                           "Broken pipe", "remote process exited", "NCCL Error 6"))
