"""The TP x DP layout built from torchrun's environment: consecutive ranks form a TP group."""
from datetime import timedelta

import pytest

import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.parallel.mappings import all_gather
from megalite.parallel.state import init_parallel
from tests.support.harness import run_distributed

pytestmark = pytest.mark.exactness


def check_layout_from_torchrun_env():
    ps = init_parallel(ParallelConfig(tp=2, timeout_minutes=0.5))
    assert dist.get_backend() == "gloo" and ps.device == torch.device("cpu")
    assert ps.timeout == timedelta(seconds=30)
    me = torch.tensor([ps.rank])
    return (ps.rank, ps.tp_rank, ps.dp_rank, ps.world_size,
            all_gather(me, 0, ps.tp_group).tolist(), all_gather(me, 0, ps.dp_group).tolist(),
            all_gather(me, 0, ps.block_group(1) or ps.tp_group).tolist())


def test_tp_groups_are_consecutive_ranks_and_dp_groups_stride_by_tp():
    results = run_distributed(check_layout_from_torchrun_env, 4, torchrun_env=True)
    assert results == [
        (0, 0, 0, 4, [0, 1], [0, 2], [0, 1]),
        (1, 1, 0, 4, [0, 1], [1, 3], [0, 1]),
        (2, 0, 1, 4, [2, 3], [0, 2], [2, 3]),
        (3, 1, 1, 4, [2, 3], [1, 3], [2, 3]),
    ]
