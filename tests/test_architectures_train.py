"""Each architecture's recipe trains at every layout as one process does: losses, gradient
norms (clipping active) and final weights after 10 steps, to 1e-5 (fp32). Sliding windows are
shorter than the rows (packed rows: shorter than most documents), so the window is real in
training, under CP (all-gather and ring) and across pipeline stages."""
import pytest

from tests.support.runs import LLAMA, assert_same_training, common, train_run

pytestmark = pytest.mark.exactness

QWEN3 = LLAMA + ["model.attention.qk_norm=true", "model.attention.head_dim=16", "model.attention.sliding_window=8",
                 "model.attention.sliding_window_pattern=2"]
ARCHITECTURES = {  # name -> (its settings, rows)
    "qwen2": (LLAMA + ["model.attention.qkv_bias=true"], "padded"),
    "mistral": (LLAMA + ["model.attention.head_dim=16", "model.attention.sliding_window=8"], "packed"),
    "qwen3": (QWEN3, "packed"),
    "qwen3_moe": (QWEN3 + ["model.mlp.kind=moe", "model.mlp.experts=4", "model.mlp.top_k=2", "model.mlp.expert_ffn_hidden=24",
                           "model.mlp.dense_layers=[0]", "model.tie_embeddings=true"], "padded"),
    "gemma3": (LLAMA + ["model.mlp.activation=geglu_tanh", "model.norms.weight_offset=1.0",
                        "model.norms.post_norms=true", "model.scale_embeddings=true",
                        "model.attention.qk_norm=true", "model.attention.head_dim=16",
                        "model.attention.query_pre_attn_scalar=24", "model.attention.sliding_window=8",
                        "model.attention.sliding_window_pattern=2", "model.positions.local_theta=100",
                        "model.positions.theta=1e6", "model.tie_embeddings=true",
                        "model.final_logit_softcap=3.0"], "packed"),
}
LAYOUTS = {
    "tp2-dp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2-cp2": ["parallel.pp=2", "parallel.cp=2"],
}
# The second layout of some runs: experts over EP, the ring instead of the all-gather.
EXTRA = {("qwen3_moe", "tp2-dp2-sp"): ["parallel.ep=2"], ("qwen3_moe", "pp2-cp2"): ["parallel.ep=2"],
         ("mistral", "pp2-cp2"): ["parallel.cp_comm=p2p"], ("qwen3", "pp2-cp2"): ["parallel.cp_comm=p2p"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_trains_like_one_process(tmp_path, cache, single, name, layout):
    settings, mode = ARCHITECTURES[name]
    run_dir = tmp_path / layout
    train_run(4, common(cache, run_dir, mode) + settings + LAYOUTS[layout]
              + EXTRA.get((name, layout), []) + ["train.micro_batch_size=2"])
    assert_same_training(single(settings, mode), run_dir)
