"""Run a function on N gloo processes and fail fast: the suite never hangs.

    results = run_distributed(check_something, 4, arg1, arg2)

Each rank runs `fn(*args)` after init_process_group (gloo, a file store in a temporary
directory, so there is no port to collide on) and reports its return value or traceback.
The parent fails as soon as one rank raises, dies without reporting, or the timeout passes,
and kills the others, which would otherwise wait forever in their next collective. On the
timeout it reports where each unfinished rank was (its Python stacks). Each rank also bounds
itself (guard_rank), since the forkserver, not the test, is its parent: once the test process
is gone (pytest killed) it exits within a second, and a rank nobody ends exits on its own
RANK_MARGIN_S after the timeout, writing its stacks first.

By hand under torchrun (the rendezvous then comes from torchrun's environment):
    torchrun --nproc_per_node 2 -m tests.support.harness tests.test_layers:check_linear_layers 2
"""
from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import queue as queue_lib
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.nodes import free_port


class DistributedFailure(AssertionError):
    pass


# Asks a rank for its stacks: SIGUSR1, SIGTERM and SIGINT are megalite's preemption signals.
STACKS_SIGNAL = signal.SIGUSR2
# A rank that outlives the parent's timeout by this exits by itself (the parent kills it first).
RANK_MARGIN_S = 60.0
ORPHAN_EXIT = 70  # a rank's exit status once its test process is gone

_stack_file = None  # faulthandler writes to its descriptor: kept open for the process's life


def guard_rank(test_pid: int, stack_path: str, limit_s: float, poll_s: float = 1.0) -> None:
    """Bounds this process: its Python stacks go to stack_path on STACKS_SIGNAL, on a fatal
    signal, and at limit_s, when it then exits (faulthandler: a C thread and C signal handlers,
    so this also works while the rank is stuck in a C call such as a gloo wait); and it exits
    with ORPHAN_EXIT once test_pid is gone."""
    global _stack_file
    _stack_file = open(stack_path, "w")
    faulthandler.enable(file=_stack_file, all_threads=True)
    faulthandler.register(STACKS_SIGNAL, file=_stack_file, all_threads=True)
    faulthandler.dump_traceback_later(limit_s, exit=True, file=_stack_file)

    def exit_when_gone():
        while True:
            time.sleep(poll_s)
            try:
                os.kill(test_pid, 0)
            except ProcessLookupError:
                print(f"pid {os.getpid()}: the test process {test_pid} is gone; exiting",
                      file=sys.stderr, flush=True)
                os._exit(ORPHAN_EXIT)
            except PermissionError:  # alive, another user's (the pid was reused): keep waiting
                pass
    threading.Thread(target=exit_when_gone, name="harness-orphan-guard", daemon=True).start()


def _worker(fn, rank, world_size, init_file, results, args, timeout, torchrun_env, test_pid,
            stack_path):
    guard_rank(test_pid, stack_path, timeout + RANK_MARGIN_S)
    torch.set_num_threads(1)
    try:
        if torchrun_env:
            os.environ.update(torchrun_env, RANK=str(rank), LOCAL_RANK=str(rank),
                              WORLD_SIZE=str(world_size))
        else:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout))
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0,
                    torchrun_env: bool = False) -> list:
    """fn's return value on each rank, in rank order.

    torchrun_env=True gives each rank torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK,
    LOCAL_RANK, WORLD_SIZE) instead of an initialised process group: `fn` initialises it.
    """
    try:
        return _run_once(fn, world_size, args, timeout, torchrun_env)
    except DistributedFailure as failure:
        # Gloo's connection of the ranks to each other, failing now and then on this loaded
        # 2-core machine ("Connection closed by peer" while a group is made: 2 of about 8 full
        # runs, never twice in a row): once more, from new processes. Any other failure, or
        # this one again, is the test's.
        if CONNECT_FLAKE not in str(failure):
            raise
        print(f"run_distributed: retried once after: {CONNECT_FLAKE}", file=sys.stderr)
        return _run_once(fn, world_size, args, timeout, torchrun_env)


CONNECT_FLAKE = "Gloo connectFullMesh failed"


def _run_once(fn, world_size: int, args: tuple, timeout: float, torchrun_env: bool) -> list:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())} if torchrun_env else None
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        stacks = [os.path.join(tmp, f"rank{rank}.stacks") for rank in range(world_size)]
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, rank, world_size, os.path.join(tmp, "store"), results,
                                   args, timeout, env, os.getpid(), stacks[rank]))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout, stacks)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()


def _context():
    """Ranks forked from a server that has imported torch and megalite once for the session:
    a fresh interpreter per rank (spawn) would import them again each time, seconds per rank on
    two cores. The server has run no torch op, so no thread pool is forked with it. It starts
    at the first call, with that moment's environment, working directory and sys.path, which
    every later rank gets: pass what a rank needs as arguments (or torchrun_env), not through
    os.environ set by the test. Also preloaded, each a second or so per rank otherwise:
    torch._dynamo (imported by every optimizer's constructor), inductor's compile_fx (by every
    torch.compile, DeepSpeed's import included), matplotlib.pyplot (the trainer's loss plot),
    pytest and transformers (a rank imports the test module whose function it runs, and that
    imports pytest, and transformers where it compares with it: half a second to a second per
    rank, on every call; a module not installed is skipped)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "torch._inductor.compile_fx", "matplotlib.pyplot", "megalite.train",
                                "pytest", "transformers", "tests.support.harness"])
    return ctx


def _collect(procs, results, timeout: float, stacks: list[str]) -> list:
    done: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue_lib.Empty:
            if _dead(procs, done, stacks):
                _fail(procs, done, "", stacks)
            if time.monotonic() > deadline:
                waiting = [r for r in range(len(procs)) if r not in done]
                _fail(procs, done, f"timed out after {timeout:.0f}s; ranks {waiting} had not finished"
                      + _where(procs, waiting, stacks), stacks)
            continue
        if not ok:
            # A rank that died makes its peers' collectives raise too: give the dead rank a
            # moment to be seen, so the report names the root cause first.
            time.sleep(1.0)
            _fail(procs, done, f"rank {rank} raised:\n{payload}", stacks)
        done[rank] = pickle.loads(payload)
    return [done[r] for r in range(len(procs))]


def _where(procs, waiting: list[int], stacks: list[str], wait_s: float = 5.0) -> str:
    """Each waiting rank's Python stacks, asked for by STACKS_SIGNAL (faulthandler writes them
    from its signal handler, whatever the rank is doing)."""
    asked = []
    for r in waiting:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, STACKS_SIGNAL)
                asked.append(r)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(_read(stacks[r]).strip() for r in asked):
        time.sleep(0.05)
    time.sleep(0.2)  # the last lines of a dump being written
    return "".join(f"\nrank {r} was at (its stacks, most recent call first):\n"
                   f"{_read(stacks[r]).strip() or '(none written: it had not reached its function)'}"
                   for r in waiting)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _dead(procs, done, stacks: list[str]) -> list[str]:
    """With the stacks faulthandler wrote, if any (a fatal signal, or the rank's own limit)."""
    return [f"rank {r} died with exit code {p.exitcode} before reporting a result"
            + (f"; its stacks:\n{_read(stacks[r]).strip()}" if _read(stacks[r]).strip() else "")
            for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]


def _fail(procs, done, message: str, stacks: list[str]):
    dead = _dead(procs, done, stacks)
    for p in procs:
        if p.is_alive():
            p.kill()
    raise DistributedFailure("\n".join(dead + ([message] if message else [])))


def main(argv: list[str]) -> None:
    """torchrun entry point: `-m tests.support.harness module:function [int args...]`."""
    module, name = argv[0].split(":")
    dist.init_process_group("gloo")
    try:
        getattr(importlib.import_module(module), name)(*(int(a) for a in argv[1:]))
        print(f"rank {dist.get_rank()}: {argv[0]} passed")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
