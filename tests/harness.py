"""Run a function on N gloo processes and fail fast: the suite never hangs.

    results = run_distributed(check_something, 4, arg1, arg2)

Each rank runs `fn(*args)` after init_process_group (gloo, a file store in a temporary
directory, so there is no port to collide on) and reports its return value or traceback.
The parent fails as soon as one rank raises, dies without reporting, or the timeout passes,
and kills the others, which would otherwise wait forever in their next collective.

By hand under torchrun (the rendezvous then comes from torchrun's environment):
    torchrun --nproc_per_node 2 -m tests.harness tests.test_layers:check_linear_layers 2
"""
from __future__ import annotations

import importlib
import os
import pickle
import queue as queue_lib
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.nodes import free_port


class DistributedFailure(AssertionError):
    pass


def _worker(fn, rank, world_size, init_file, results, args, timeout, torchrun_env):
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
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, rank, world_size, os.path.join(tmp, "store"), results,
                                   args, timeout, env))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout)
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
                                "pytest", "transformers", "tests.harness"])
    return ctx


def _collect(procs, results, timeout: float) -> list:
    done: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue_lib.Empty:
            if _dead(procs, done):
                _fail(procs, done, "")
            if time.monotonic() > deadline:
                waiting = [r for r in range(len(procs)) if r not in done]
                _fail(procs, done, f"timed out after {timeout:.0f}s; ranks {waiting} had not finished")
            continue
        if not ok:
            # A rank that died makes its peers' collectives raise too: give the dead rank a
            # moment to be seen, so the report names the root cause first.
            time.sleep(1.0)
            _fail(procs, done, f"rank {rank} raised:\n{payload}")
        done[rank] = pickle.loads(payload)
    return [done[r] for r in range(len(procs))]


def _dead(procs, done) -> list[str]:
    return [f"rank {r} died with exit code {p.exitcode} before reporting a result"
            for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]


def _fail(procs, done, message: str):
    dead = _dead(procs, done)
    for p in procs:
        if p.is_alive():
            p.kill()
    raise DistributedFailure("\n".join(dead + ([message] if message else [])))


def main(argv: list[str]) -> None:
    """torchrun entry point: `-m tests.harness module:function [int args...]`."""
    module, name = argv[0].split(":")
    dist.init_process_group("gloo")
    try:
        getattr(importlib.import_module(module), name)(*(int(a) for a in argv[1:]))
        print(f"rank {dist.get_rank()}: {argv[0]} passed")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
