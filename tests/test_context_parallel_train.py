"""The trainer with context parallelism trains the same model as one process, step for step:
losses, gradient norms (clipping active) and final weights, to 1e-5. The padded reference is
the session's TP2 x DP2 run (conftest.py), itself equal to one process (tests/test_train.py);
the packed one a single process. Each run's checkpoint records the layout it really ran."""
import json

import pytest

from tests.support.resume import resume_and_compare
from tests.support.runs import STEPS, assert_same_training, common, train_run

pytestmark = pytest.mark.exactness


def ran_at(run_dir) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())["layout"]


@pytest.mark.parametrize("layout, expected, resume_at_cp1", [
    # README's command: parallel.cp=2 parallel.tp=2 on 4 processes (DP=1, 4 micro-batches).
    (["parallel.tp=2", "parallel.cp=2", "train.checkpoint_every=5"], {"tp": 2, "cp": 2, "pp": 1, "dp": 1}, True),
    (["parallel.pp=2", "parallel.cp=2", "parallel.cp_comm=p2p"], {"tp": 1, "cp": 2, "pp": 2, "dp": 1}, False),
], ids=["cp2xtp2-resumed-at-cp1", "cp2xpp2-p2p"])
def test_padded_rows_train_like_one_process(tmp_path, cache, tp2dp2_padded, layout, expected,
                                            resume_at_cp1):
    run_dir = tmp_path / "cp"
    train_run(4, common(cache, run_dir, "padded") + layout + ["train.micro_batch_size=2"])
    assert ran_at(run_dir) == expected
    assert_same_training(tp2dp2_padded, run_dir)
    if resume_at_cp1:
        resume_and_compare(cache, run_dir, run_dir / "checkpoints" / "step_00000005", tmp_path / "cp1", 1, 1)


@pytest.fixture(scope="module")
def single_packed(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("single-packed")
    train_run(1, common(cache, run_dir, "packed") + ["parallel.tp=1", "train.micro_batch_size=8"])
    return run_dir


@pytest.mark.parametrize("layout, expected", [
    (["parallel.cp=2"], {"tp": 1, "cp": 2, "pp": 1, "dp": 2}),
    (["parallel.cp=4", "parallel.cp_comm=p2p"], {"tp": 1, "cp": 4, "pp": 1, "dp": 1}),
    (["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp_comm=p2p"],
     {"tp": 2, "cp": 2, "pp": 1, "dp": 1}),
], ids=["cp2xdp2-all_gather", "cp4-p2p", "cp2xtp2-sp-p2p"])
def test_packed_rows_train_like_one_process(tmp_path, cache, single_packed, layout, expected):
    run_dir = tmp_path / "cp"
    train_run(4, common(cache, run_dir, "packed") + layout + ["train.micro_batch_size=2"])
    assert ran_at(run_dir) == expected
    assert_same_training(single_packed, run_dir)


# Llama's shape: rotary positions, GQA (2 K/V heads for 4), SwiGLU, RMSNorm, untied head; a
# higher learning rate, so that it visibly learns in 10 steps. (At 1e-2 step 9 spikes, and its
# gradient norm moves by 6e-5 with the micro-batch size alone, in one process.)
LLAMA = ["model.positions.kind=rotary", "model.attention.n_kv_heads=2",
         "model.mlp.activation=swiglu", "model.norms.kind=rmsnorm", "model.bias=false",
         "model.tie_embeddings=false", "train.lr=5e-3"]


def test_llama_shape_right_padded_at_cp4_all_gather_and_cp2_tp2_ring(tmp_path, cache):
    single = tmp_path / "single"
    train_run(1, common(cache, single, "padded") + LLAMA + ["parallel.tp=1", "train.micro_batch_size=8"])
    for name, layout in {"cp4": ["parallel.cp=4"],
                         "cp2tp2": ["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm=p2p"]}.items():
        train_run(4, common(cache, tmp_path / name, "padded") + LLAMA + layout + ["train.micro_batch_size=4"])
        assert_same_training(single, tmp_path / name)
