"""The harness itself: a failing, dying or hanging rank fails the test quickly, never hangs,
and a rank left behind (its test process gone, or nobody ending it) ends itself."""
import inspect
import os
import re
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import DistributedFailure, ORPHAN_EXIT, _context, guard_rank, run_distributed

pytestmark = pytest.mark.e2e


def check_rank_one_raises():
    if dist.get_rank() == 1:
        raise RuntimeError("planted failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 would wait here forever


def check_rank_one_dies():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def check_hangs():
    time.sleep(600)


def check_returns_rank():
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return dist.get_rank(), value.item()


def test_results_come_back_in_rank_order():
    assert run_distributed(check_returns_rank, 2) == [(0, 1.0), (1, 1.0)]


def test_a_raising_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedFailure, match="(?s)rank 1 raised.*planted failure on rank 1"):
        run_distributed(check_rank_one_raises, 2)
    assert time.monotonic() - start < 60


def test_a_dying_rank_is_reported():
    with pytest.raises(DistributedFailure, match="rank 1 died with exit code 3"):
        run_distributed(check_rank_one_dies, 2)


def test_a_hang_times_out():
    with pytest.raises(DistributedFailure, match=r"timed out after 5s; ranks \[0, 1\]"):
        run_distributed(check_hangs, 2, timeout=5)


def line_of(fn, marker: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if marker in line)


def check_rank_one_stuck():
    if dist.get_rank() == 1:
        time.sleep(600)  # stuck here
    return dist.get_rank()


def test_a_timeout_names_the_stuck_rank_and_the_line_it_is_on():
    start = time.monotonic()
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(check_rank_one_stuck, 2, timeout=5)
    assert time.monotonic() - start < 30
    message = str(failure.value)
    assert "timed out after 5s; ranks [1] had not finished" in message and "rank 0 was" not in message
    line = line_of(check_rank_one_stuck, "# stuck here")
    assert re.search(rf'rank 1 was at .*\n(.*\n)*  File ".*test_harness\.py", line {line} in '
                     rf'check_rank_one_stuck', message), message


def stuck_guarded(test_pid: int, stack_path: str, limit_s: float):
    guard_rank(test_pid, stack_path, limit_s, poll_s=0.1)
    time.sleep(600)  # stuck too


def test_a_rank_whose_test_process_is_gone_exits_by_itself(tmp_path):
    """As when pytest is killed: the rank's parent is the forkserver, so nobody ends it."""
    test_process = subprocess.Popen(["sleep", "600"])  # stands in for the test process
    rank = _context().Process(target=stuck_guarded, daemon=True,
                              args=(test_process.pid, str(tmp_path / "stacks"), 600))
    rank.start()
    try:
        rank.join(timeout=1)
        assert rank.exitcode is None  # not while its test process lives
        test_process.kill()
        test_process.wait(timeout=10)  # reaped: a zombie's pid would still answer os.kill
        rank.join(timeout=10)
        assert rank.exitcode == ORPHAN_EXIT
    finally:
        test_process.kill()
        rank.kill()


def test_a_rank_nobody_ends_writes_its_stacks_and_exits_at_its_limit(tmp_path):
    stacks = tmp_path / "stacks"
    rank = _context().Process(target=stuck_guarded, daemon=True,
                              args=(os.getpid(), str(stacks), 1.0))
    rank.start()
    try:
        rank.join(timeout=30)
        assert rank.exitcode == 1  # faulthandler's exit
    finally:
        rank.kill()
    line = line_of(stuck_guarded, "# stuck too")
    assert f'test_harness.py", line {line} in stuck_guarded' in stacks.read_text(), stacks.read_text()


def check_connect_fails(marker: str, times: int):
    """Rank 0 fails as gloo's connection of the ranks does, the first `times` calls."""
    from pathlib import Path
    calls = Path(marker)
    if dist.get_rank() == 0:
        n = int(calls.read_text()) if calls.exists() else 0
        calls.write_text(str(n + 1))
        if n < times:
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed "
                               "by peer (planted)")
    return dist.get_rank()


def test_gloos_connect_flake_is_retried_once_and_only_once(tmp_path):
    assert run_distributed(check_connect_fails, 2, str(tmp_path / "once"), 1) == [0, 1]
    with pytest.raises(DistributedFailure, match="connectFullMesh failed"):
        run_distributed(check_connect_fails, 2, str(tmp_path / "twice"), 2)
    with pytest.raises(DistributedFailure, match="planted failure"):  # another: not retried
        run_distributed(check_rank_one_raises, 2)
