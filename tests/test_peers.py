"""Naming the rank that died (training/peers.py), in this process: a peer on this host is named
even when the transport reports the closed connection before the peer's process shows as ended
(the kernel closes a killed process's sockets first); otherwise the peer was on another node."""
import os
import socket
import subprocess
import threading
import time

import pytest

from megalite.parallel.state import ParallelState
from megalite.training.peers import SETTLE_S, Peers

pytestmark = pytest.mark.e2e

CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")


def peers_with(pid: int) -> Peers:
    peers = Peers(ParallelState())  # one process: no collective
    peers.table = [(socket.gethostname(), os.getpid()), (socket.gethostname(), pid)]
    peers.step = 4
    return peers


def test_a_peer_that_ends_just_after_the_failure_is_named():
    peer = subprocess.Popen(["sleep", "60"])
    try:
        threading.Timer(0.2, peer.kill).start()  # still running when the failure is looked at
        lost = peers_with(peer.pid).lost(CLOSED)
        assert str(lost).startswith(f"rank 1 (pid {peer.pid}) on {socket.gethostname()} died "
                                    "during step 4: this rank stops too"), lost
    finally:
        peer.kill()
        peer.wait(timeout=10)


def test_a_peer_elsewhere_is_said_to_be_on_another_node_after_the_settling_time():
    peer = subprocess.Popen(["sleep", "60"])
    try:
        started = time.monotonic()
        lost = peers_with(peer.pid).lost(CLOSED)
        assert time.monotonic() - started >= SETTLE_S
        assert str(lost).startswith("a peer on another node died during step 4 (this node's "
                                    "ranks are alive"), lost
        # A failure in other words, nobody here gone: not a lost peer's, said at once.
        started = time.monotonic()
        assert peers_with(peer.pid).lost(RuntimeError("shapes differ")) is None
        assert time.monotonic() - started < SETTLE_S
    finally:
        peer.kill()
        peer.wait(timeout=10)
