"""DeepSpeed ZeRO as the data-parallel engine (train.engine=deepspeed) is the same training as
the native engine (conftest.py's TP=2 x DP=2 run): per-step losses, gradient norms, final
weights and Adam moments, with gradient accumulation; a ZeRO run resumes from a native
checkpoint; DP replicas hold identical parameters; bad DeepSpeed configs fail before any
process starts.
"""
import pytest
import torch
import torch.distributed as dist

from megalite.config import GroupedQuery, ModelConfig, ParallelConfig
from megalite.run_config import TrainConfig
from megalite.plan import raise_problems
from megalite.training.deepspeed_engine import deepspeed_problems
from megalite.typed_config import ConfigError
from tests.support.checkpoints import read_whole_state
from tests.support.harness import run_distributed
from tests.support.runs import LAYOUT, STEPS, assert_same_training, common, losses, train_run

pytestmark = pytest.mark.deepspeed  # every test: skipped without the package (tests/conftest.py)


def moments(run_dir, step=STEPS):
    return read_whole_state(run_dir / "checkpoints" / f"step_{step:08d}", "optimizer")


@pytest.mark.exactness
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_trains_like_the_native_engine(tmp_path, cache, tp2dp2_padded, stage):
    train_run(4, common(cache, tmp_path, "padded") + LAYOUT +
              ["train.engine=deepspeed", f"train.zero_stage={stage}"])
    assert_same_training(tp2dp2_padded, tmp_path)
    # Its checkpoint holds the whole Adam state, gathered from ZeRO's partitions.
    expected, saved = moments(tp2dp2_padded), moments(tmp_path)
    assert saved.keys() == expected.keys() and len(saved) == 2 * 32
    for name in expected:
        torch.testing.assert_close(saved[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.exactness
def test_zero2_resumes_from_a_native_checkpoint(tmp_path, cache, tp2dp2_padded):
    train_run(4, common(cache, tmp_path, "padded") + LAYOUT +
              ["train.engine=deepspeed", "train.zero_stage=2",
               f"train.resume={tp2dp2_padded / 'checkpoints' / 'step_00000005'}"])
    whole, resumed = losses(tp2dp2_padded), losses(tmp_path)
    assert sorted(resumed) == list(range(6, STEPS + 1))
    for step in resumed:
        assert abs(resumed[step] - whole[step]) <= 1e-5, (step, resumed[step], whole[step])


def check_replicas_stay_identical(stage: int) -> None:
    """ZeRO-`stage` at TP2 x DP2, each DP rank on its own data: after 3 steps every DP replica
    holds the same parameters, and they moved."""
    from megalite.model import GPT
    from megalite.parallel.state import init_parallel
    from megalite.training.build import build_engine
    ps = init_parallel(ParallelConfig(tp=2))  # from torchrun's environment, as DeepSpeed wants
    model = GPT(ModelConfig(n_layers=2, hidden=32, n_heads=4, vocab_size=96, max_seq_len=16), ps, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    engine = build_engine(model, TrainConfig(global_batch_size=4, micro_batch_size=1, engine="deepspeed",
                                             zero_stage=stage), ps)
    data = torch.Generator().manual_seed(ps.dp_rank)
    for _ in range(3):
        for last in (False, True):
            ids = torch.randint(0, 96, (1, 16), generator=data)
            engine.backward(engine.module(ids, labels=ids).token_losses.mean(), last=last)
        engine.step()
    for p, p0 in zip(model.parameters(), before):
        replicas = [torch.empty_like(p) for _ in range(ps.dp_size)]
        dist.all_gather(replicas, p.detach().contiguous(), group=ps.dp_group)
        assert torch.equal(replicas[0], replicas[1])
        assert not torch.equal(p.detach(), p0)


@pytest.mark.exactness
def test_zero2_dp_replicas_hold_identical_parameters():
    run_distributed(check_replicas_stay_identical, 4, 2, torchrun_env=True)


TP2 = ParallelConfig(tp=2)


@pytest.mark.unit
@pytest.mark.parametrize("model, train, parallel, world, message", [
    (ModelConfig(n_heads=4, attention=GroupedQuery(n_kv_heads=1)), {}, TP2, 4,
     "model.attention.n_kv_heads=1 < parallel.tp=2"),
    (ModelConfig(), {"deepspeed": {"train_batch_size": 32}}, TP2, 4, "train_batch_size=32 disagrees"),
    (ModelConfig(), {"deepspeed": {"optimizer": {"type": "Adam"}}}, TP2, 4, "train.deepspeed.optimizer"),
    (ModelConfig(), {"deepspeed": {"zero_optimization": {"stage": 3}}}, TP2, 4, "zero_optimization.stage"),
    (ModelConfig(), {"zero_stage": 0, "deepspeed": {"data_types": {"grad_accum_dtype": "bf16"}}},
     TP2, 4, "train.deepspeed.data_types.grad_accum_dtype"),
    (ModelConfig(), {}, TP2, None, "runs under torchrun"),
    (ModelConfig(), {"precision": "pure_bf16"}, TP2, 4, "pure_bf16 needs train.engine=native"),
    (ModelConfig(), {"zero_stage": 0}, ParallelConfig(pp=2), 4,
     "train.zero_stage=0 with parallel.pp=2: stage 0 is plain data parallelism"),
])
def test_bad_deepspeed_configs_are_refused_before_any_collective(model, train, parallel, world, message):
    cfg = TrainConfig(engine="deepspeed", global_batch_size=16, micro_batch_size=4, **train)
    with pytest.raises(ConfigError, match=message):
        raise_problems(deepspeed_problems(cfg, model, parallel, world))


@pytest.mark.exactness
@pytest.mark.parametrize("stage, extra", [
    (1, ["train.deepspeed.zero_optimization.overlap_comm=true"]),  # ZeRO's reduce hooks on
    (2, []),
])
def test_zero_with_pipeline_stages_trains_like_the_native_engine(tmp_path, cache, tp2dp2_padded,
                                                                 stage, extra):
    """PP2 x DP2: ZeRO partitions each stage's optimizer state (and gradients) over its DP group,
    and the tied embedding's two copies (first and last stage) sum their gradients before the
    DP reduction."""
    train_run(4, common(cache, tmp_path, "padded") +
              ["parallel.tp=1", "parallel.pp=2", "train.micro_batch_size=2",
               "train.engine=deepspeed", f"train.zero_stage={stage}", *extra])
    assert_same_training(tp2dp2_padded, tmp_path)
    expected, saved = moments(tp2dp2_padded), moments(tmp_path)
    assert saved.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(saved[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.exactness
def test_latent_attention_at_tp2_trains_like_the_native_engine(tmp_path, cache):
    """DeepSeek-V3's shape at TP2 x DP2 under ZeRO-1: MLA's down-projections, whole on every TP
    rank, count once in DeepSpeed's gradient norm (clipping is active), as in the native one."""
    from tests.support.runs import DEEPSEEK
    native, zero = tmp_path / "native", tmp_path / "zero1"
    argv = common(cache, tmp_path, "padded") + DEEPSEEK + LAYOUT
    train_run(4, argv + [f"run.dir={native}"])
    train_run(4, argv + [f"run.dir={zero}", "train.engine=deepspeed", "train.zero_stage=1"])
    assert_same_training(native, zero)
