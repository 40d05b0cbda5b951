"""DeepSeek-V3's shape (multi-head latent attention with a query latent, a dense layer then
MoE layers with a shared expert, group-limited sigmoid routing with the auxiliary-loss-free
bias and a routed scale) trains at TP2 x DP2, TP2 + SP, EP2 x TP2, PP2 and CP2 as one process
does: losses, gradient norms (clipping active) and final weights after 10 steps, to 1e-5
(fp32), padded and packed."""
import pytest

from tests.test_architectures_train import LLAMA, single  # noqa: F401  (the fixture)
from tests.test_moe_train import assert_docs_command_trains_like_one_process
from tests.test_train import assert_same_training, common, train_run

# Llama's shape but its KV heads (a key latent attention does not have).
DEEPSEEK = [s for s in LLAMA if not s.startswith("model.attention.n_kv_heads=")] + [
    "model.attention.kind=mla", "model.attention.q_lora_rank=24", "model.attention.kv_lora_rank=16",
    "model.attention.qk_nope_head_dim=8", "model.attention.qk_rope_head_dim=4", "model.attention.v_head_dim=12",
    "model.mlp.kind=moe", "model.mlp.experts=4", "model.mlp.top_k=2", "model.mlp.expert_ffn_hidden=16",
    "model.mlp.shared_experts=1", "model.mlp.router=sigmoid", "model.mlp.groups=2", "model.mlp.topk_groups=1",
    "model.mlp.routed_scaling=2.5", "model.mlp.dense_layers=[0]", "model.mlp.bias_update_rate=0.01",
    "model.n_layers=3", "parallel.pp_layers=null"]
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
