"""DeepSeek-V3 against transformers itself (CPU, fp32): random DeepseekV3ForCausalLM models (a
dense layer then MoE layers with a shared expert, group-limited sigmoid routing with a
correction bias and a routed scale; q_lora on and off; weights and biases perturbed off their
init) imported by `megalite import`, evaluated by `megalite eval` (torchrun's environment)
at TP2 and at TP2 x EP2 with transformers' loss, exported back with the same loss, and greedy generation at
TP2 through the latent KV cache equal to transformers'. The router's choices equal
transformers' on the same scores, ties included; the cache holds the latent and the rotary
key per token, as its formula says."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megalite.config import Dense, GroupedQuery, Latent, ModelConfig, Norms, Rotary  # noqa: E402
from megalite.hf.convert import checkpoint_model_config  # noqa: E402
from megalite.model import GPT  # noqa: E402
from megalite.model.router import group_limited  # noqa: E402
from megalite.parallel.state import ParallelState  # noqa: E402
from tests.support.harness import run_distributed  # noqa: E402
from tests.support.hf import CONTEXT, VOCAB, run_cli, same_as_transformers  # noqa: E402


def deepseek_config(q_lora_rank):
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, max_position_embeddings=CONTEXT, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-6,
        tie_word_embeddings=False)


def random_deepseek(directory, tokenizer_file, q_lora_rank):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(deepseek_config(q_lora_rank)).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in [*hf.parameters(), *(b for n, b in hf.named_buffers() if "correction" in n)]:
            t.add_(torch.randn(t.shape, generator=generator) * 0.3)
    hf.save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    return hf


@pytest.mark.exactness
@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no-q_lora"])
def test_deepseek_v3_evaluates_exports_and_generates_as_transformers(tmp_path, tokenizer_file,
                                                                    q_lora_rank):
    hf = random_deepseek(tmp_path / "hf", tokenizer_file, q_lora_rank)
    run_cli("import", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "ckpt"))
    cfg = checkpoint_model_config(tmp_path / "ckpt")
    assert (cfg.attention.kind, cfg.attention.q_lora_rank, cfg.mlp.dense_layers, cfg.mlp.groups,
            cfg.mlp.routed_scaling) == ("mla", q_lora_rank, (0,), 2, 2.5)
    same_as_transformers(hf, tmp_path, [[], ["--ep", "2"]])


@pytest.mark.unit
@pytest.mark.parametrize("bias", [[0.0] * 8, [0.5, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.5]])
def test_group_limited_choices_equal_transformers_ties_included(bias):
    """Logits of two values, so that experts and groups tie at the cut (checked)."""
    config = deepseek_config(None)
    config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok = 8, 4, 2, 3
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    logits = torch.randint(0, 2, (500, 8), generator=torch.Generator().manual_seed(0)).float()
    bias = torch.tensor(bias)
    router.e_score_correction_bias.copy_(bias)
    with torch.no_grad():
        router.weight.copy_(torch.eye(8, 32))  # logits = the first 8 hidden features
        _, _, theirs = router(torch.nn.functional.pad(logits, (0, 24)))
    picking = logits.sigmoid() + bias
    ours = group_limited(picking, 4, 2, 3)
    assert (ours.sort(-1).values == theirs.sort(-1).values).all()
    groups = picking.view(500, 4, 2).sum(-1).sort(-1, descending=True).values
    assert (groups[:, 1] == groups[:, 2]).sum() > 50  # ties at the groups' cut
    assert (picking.gather(1, ours).diff(dim=-1) <= 0).all()  # best first


@pytest.mark.exactness
def test_the_latent_cache_holds_the_latent_and_the_rotary_key():
    """Bytes per token and layer: (kv_lora_rank + qk_rope_head_dim) x 4 (fp32), the same at
    every TP rank; GQA's: 2 x kv_heads / tp x head_dim x 4."""
    llama = dict(positions=Rotary(), norms=Norms(kind="rmsnorm"), mlp=Dense(activation="swiglu"),
                 bias=False, vocab_size=100, n_layers=3, hidden=32, n_heads=4, max_seq_len=32)
    mla = ModelConfig(attention=Latent(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                       v_head_dim=12), **llama)
    gqa = ModelConfig(attention=GroupedQuery(n_kv_heads=2), **llama)
    assert GPT(mla, ParallelState()).new_cache(2, 10).bytes_per_token() == 3 * (16 + 4) * 4
    assert GPT(gqa, ParallelState()).new_cache(2, 10).bytes_per_token() == 3 * 2 * 2 * 8 * 4
    assert run_distributed(cache_bytes_at_tp2, 2, mla) == [3 * (16 + 4) * 4] * 2


def cache_bytes_at_tp2(cfg):
    return GPT(cfg, ParallelState.from_world(2)).new_cache(1, 10).bytes_per_token()


def logits_of(directory, ids):
    from megalite.hf.convert import load_pretrained, pretrained_config
    model = GPT(pretrained_config(directory), ParallelState(), init=False)
    load_pretrained(directory, model, ParallelState())
    with torch.no_grad():
        return model.full_logits(model(ids).logits)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2"])
def test_yarn_scaled_models_give_transformers_logits(tmp_path, tokenizer_file, name):
    """YaRN over a pretraining context of 16 in a model of 64 (factor 4): the ramped
    frequencies, cos and sin times the attention factor, and DeepSeek-V3's softmax rescaled by
    its mscale_all_dim correction squared; logits at every position to 1e-5."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0}
    if name == "deepseek_v3":
        config = deepseek_config(24)
        config.rope_parameters = {**yarn, "mscale": 1.0, "mscale_all_dim": 0.7}
    else:
        config = transformers.Qwen2Config(vocab_size=VOCAB, max_position_embeddings=CONTEXT,
                                          hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          rope_parameters=yarn)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(logits_of(tmp_path / "hf", ids), theirs, atol=1e-5, rtol=1e-5)
