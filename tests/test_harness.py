"""The harness itself: a failing, dying or hanging rank fails the test quickly, never hangs."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import DistributedFailure, run_distributed


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
