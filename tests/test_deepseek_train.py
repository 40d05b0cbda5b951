"""DeepSeek-V3's shape (multi-head latent attention with a query latent, a dense layer then
MoE layers with a shared expert, group-limited sigmoid routing with the auxiliary-loss-free
bias and a routed scale) trains at TP2 x DP2, TP2 + SP, EP2 x TP2, PP2 and CP2 as one process
does: losses, gradient norms (clipping active) and final weights after 10 steps, to 1e-5
(fp32), padded and packed."""
import pytest

from tests.support.runs import (DEEPSEEK, assert_docs_command_trains_like_one_process,
                                assert_same_training, common, train_run)

pytestmark = pytest.mark.exactness

LAYOUTS = {
    "tp2-dp2": ["parallel.tp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "ep2-tp2": ["parallel.tp=2", "parallel.ep=2"],
    "pp2": ["parallel.pp=2", "parallel.pp_layers=[1,2]"],
    "cp2": ["parallel.cp=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_deepseek_v3_trains_like_one_process(tmp_path, cache, single, mode, layout):
    run_dir = tmp_path / layout
    train_run(4, common(cache, run_dir, mode) + DEEPSEEK + LAYOUTS[layout]
              + ["train.micro_batch_size=2"])
    assert_same_training(single(DEEPSEEK, mode), run_dir)


def test_the_docs_command_trains_like_one_process(tmp_path, cache):
    """docs/architectures.md's DeepSeek-V3 command (configs/demo-deepseek.yaml at TP2 x EP2), a
    few steps, gives the single process's losses."""
    assert_docs_command_trains_like_one_process(tmp_path, cache, "architectures.md",
                                                "## Multi-head latent attention",
                                                "configs/demo-deepseek.yaml")
