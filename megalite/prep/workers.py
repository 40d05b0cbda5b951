"""The tokenizing processes of prepare-data: each chunk of documents in, its token ids out.

`Workers` runs them in spawned processes, or in this one (workers=0); it takes chunks with
submit() and gives results, in the order submitted, with result().
"""
import ctypes
import multiprocessing
import os
import signal
import traceback
from collections import deque
from itertools import chain
from multiprocessing import connection
from pathlib import Path

import numpy as np

from megalite.data.chat import ChatTemplate, conversation_tokens
from megalite.data.record_counts import Counts
from megalite.prep.sources import RawChunk, parse
from megalite.data.tokenizer import load_tokenizer
from megalite.typed_config import ConfigError


class WorkerDied(Exception):
    """A tokenizing process ended while the run still needed it."""


class Workers:
    """`n` spawned tokenizing processes, each behind its own pipe (n=0: none, each chunk
    tokenized in this process as it is submitted); results are taken in the order submitted.
    A chunk goes only to an idle worker (one waiting to receive), so no send waits on a worker
    that is itself waiting to send; a worker's death is seen through its sentinel whenever
    this process waits, and close() kills them all. Not a
    ProcessPoolExecutor: after a worker's death its shutdown can wait forever before Python
    3.12 (on 3.11, on a sibling it was starting meanwhile, which escaped its clean-up; on 3.10,
    on sending a chunk to the dead)."""

    def __init__(self, n: int, init: tuple):
        spawn = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []  # each worker's pipe and process
        try:
            for _ in range(n):
                ours, theirs = spawn.Pipe()
                proc = spawn.Process(target=_serve, args=(theirs, init), daemon=True)
                proc.start()
                theirs.close()  # so that its death ends our sends and reads on the pipe
                self.conns.append(ours)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise
        if n == 0:
            _init_worker(*init)
        self.idle = deque(self.conns)  # the pipes of the workers waiting for a chunk
        self.queued: deque = deque()  # (ticket, chunk, name) not yet sent
        self.busy: dict = {}  # a worker's pipe -> the ticket it works on
        self.done: dict[int, tuple] = {}  # ticket -> (ok, the result or the error)
        self.tickets = 0

    def submit(self, chunk: RawChunk, name: str) -> int:
        if self.procs:
            self.queued.append((self.tickets, chunk, name))
            self._pump(timeout=0)
        else:  # workers=0: here, now
            self.done[self.tickets] = (True, _encode(chunk, name))
        self.tickets += 1
        return self.tickets - 1

    def result(self, ticket: int) -> tuple:
        while ticket not in self.done:
            self._pump(timeout=None)
        ok, value = self.done.pop(ticket)
        if not ok:
            raise value
        return value

    def _pump(self, timeout: float | None) -> None:
        """Hand queued chunks to idle workers, then take the results ready within `timeout`."""
        while self.idle and self.queued:
            conn = self.idle.popleft()
            ticket, *task = self.queued.popleft()
            try:
                conn.send(task)
            except OSError:  # a broken pipe: it died
                raise WorkerDied from None
            self.busy[conn] = ticket
        ready = connection.wait([*self.busy, *(p.sentinel for p in self.procs)], timeout)
        if any(p.sentinel in ready for p in self.procs):
            raise WorkerDied
        for conn in ready:
            try:
                self.done[self.busy.pop(conn)] = conn.recv()
            except (EOFError, OSError):  # it died while sending
                raise WorkerDied from None
            self.idle.append(conn)

    def close(self) -> None:
        """Kill every worker: the run is over, finished or failed, and needs nothing of them."""
        for proc in self.procs:
            proc.kill()
        for proc, conn in zip(self.procs, self.conns):
            proc.join()
            conn.close()


_worker: dict = {}


def _init_worker(tokenizer: str, dtype: str, text_key: str, strict: bool,
                 chat: tuple[str, str] | None, in_pool: bool) -> None:
    """chat: (the chat template, train_on) for conversations; None for documents."""
    if in_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
        # Die with the parent: a killed prepare-data must not leave its workers running.
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        # Ctrl-C reaches the whole process group: the main process stops its workers.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    info = load_tokenizer(Path(tokenizer))
    _worker.update(info=info, dtype=np.dtype(dtype), text_key=text_key, strict=strict, render=None)
    if chat is not None:  # render: a conversation's messages made (tokens, targets)
        template = ChatTemplate(chat[0], info.names)
        _worker["render"] = lambda messages: conversation_tokens(template, info, messages, chat[1])


def _serve(conn, init: tuple) -> None:
    """A worker's life: each chunk received sent back encoded, as (True, result), or
    (False, the error), until the main process kills it."""
    _init_worker(*init)
    while True:
        chunk, name = conn.recv()
        try:
            reply = (True, _encode(chunk, name))
        except ConfigError as bad:  # bad input (--strict): the main process reports it
            reply = (False, bad)
        except Exception:
            reply = (False, RuntimeError(f"a tokenizing worker failed:\n{traceback.format_exc()}"))
        conn.send(reply)


def _encode(chunk: RawChunk, name: str) -> tuple[np.ndarray, np.ndarray, Counts, np.ndarray | None]:
    """(tokens, document lengths, counts, targets) of one chunk: each document's ids, ending
    with eos; for conversations, which tokens are targets (else None): each conversation's ids
    and targets (conversation_tokens); one the template refuses is counted as bad, by its line."""
    info, render = _worker["info"], _worker["render"]
    texts, counts = parse(chunk, _worker["text_key"], _worker["strict"], name, render)
    if render is None:
        ids, targets = info.encode_documents(texts), None
    else:
        ids, targets = [tokens for tokens, _ in texts], [wanted for _, wanted in texts]
    lengths = np.fromiter((len(d) for d in ids), dtype=np.int32, count=len(ids))
    tokens = np.fromiter(chain.from_iterable(ids), dtype=_worker["dtype"], count=int(lengths.sum()))
    if targets is not None:
        targets = np.fromiter(chain.from_iterable(targets), dtype=np.uint8, count=len(tokens))
    return tokens, lengths, counts, targets
