"""train.compile: torch.compile of the whole model (embedding, blocks, final norm, fused head +
loss) computes the same loss and gradients as eager, at TP=1 and TP=2 and under context
parallelism (CP2, K/V all-gathered and the ring's autograd function), and at TP=1 the training
forward is one graph, without a break, for padded and packed batches. The graphs are captured
with the aot_eager backend, which traces the model (dynamo and AOT autograd, as in production)
without generating kernels, to keep the test fast on CPU; inductor's kernels are measured by
the GPU benchmarks. FP8 (train.fp8) compiles to the same numbers at TP=1 and TP=2. And
train.compile_mode / train.compile_options reach torch.compile, checked before any work (CUDA
graphs, reduce-overhead, equal the ungraphed step on a GPU: tests/test_gpu.py)."""
import pytest
import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.fp8.convert import convert_to_fp8
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.run_config import Fp8Config, load_config
from megalite.plan import validate
from megalite.training.build import build_model
from megalite.typed_config import ConfigError
from tests.support.harness import run_distributed
from tests.support.models import CONFIGS, padded_batch


def packed_docs(ids: torch.Tensor) -> torch.Tensor:
    return (torch.arange(ids.shape[1]) // 5).expand_as(ids).contiguous()


def check_compiled_model_matches_eager(tp: int, name: str, layout: ParallelConfig | None = None,
                                       fp8: str = "none") -> None:
    ps = ParallelState.from_world(tp, pipeline=layout) if dist.is_initialized() else ParallelState()
    cfg = CONFIGS[name]
    ids, mask, labels = padded_batch(cfg, "right")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    results = []
    for compiled in (False, True):
        model = GPT(cfg, ps, seed=3, parallel=layout)
        assert fp8 == "none" or convert_to_fp8(model, Fp8Config(recipe=fp8, layers="all"), ps)
        if compiled:
            model.compile(backend="aot_eager")
        loss = model(ids, doc_ids=packed_docs(ids), labels=labels, loss_scale=0.1).loss
        loss.backward()
        # Both models have this rank's slices: compare them as they are.
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    # Dynamo did capture graphs (a no-op compile would pass the comparison below).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-5, rtol=1e-5)
    assert eager_grads.keys() == compiled_grads.keys()
    for key in eager_grads:
        torch.testing.assert_close(compiled_grads[key], eager_grads[key], atol=1e-5, rtol=1e-5,
                                   msg=key)


@pytest.mark.unit
def test_compiled_model_matches_eager_single_process():
    check_compiled_model_matches_eager(1, "llama")


@pytest.mark.exactness
def test_compiled_model_matches_eager_at_tp2():
    run_distributed(check_compiled_model_matches_eager, 2, 2, "gpt2")


@pytest.mark.exactness
def test_compiled_fp8_matches_eager():
    """FP8 (torchao's casts and scaled matmuls, the amax reduced over TP) compiles too."""
    check_compiled_model_matches_eager(1, "llama", fp8="rowwise")
    run_distributed(check_compiled_model_matches_eager, 2, 2, "llama", None, "tensorwise")


@pytest.mark.exactness
@pytest.mark.parametrize("cp_comm", ["all_gather", "p2p"])
def test_compiled_model_matches_eager_under_context_parallelism(cp_comm):
    run_distributed(check_compiled_model_matches_eager, 2, 1, "llama",
                    ParallelConfig(cp=2, cp_comm=cp_comm))


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_training_forward_is_one_graph_at_tp1(name, packed):
    cfg = CONFIGS[name]
    model = GPT(cfg, ParallelState(), seed=0)
    ids, _, labels = padded_batch(cfg, "right")
    docs = packed_docs(ids) if packed else None

    def training_loss(ids, docs, labels):
        return model(ids, doc_ids=docs, labels=labels, loss_scale=torch.tensor(0.1)).loss

    explained = torch._dynamo.explain(training_loss)(ids, docs, labels)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.unit
@pytest.mark.parametrize("settings, expected", [
    ([], {}),
    (["train.compile_mode=reduce-overhead"], {"mode": "reduce-overhead"}),
    (["train.compile_options={triton: {cudagraphs: true}, coordinate_descent_tuning: true}"],
     {"options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True}}),
])
def test_compile_settings_reach_torch_compile(monkeypatch, settings, expected):
    """train.compile_mode, or train.compile_options (nested keys joined with dots, as inductor
    names them), are what the model is compiled with."""
    calls = []
    monkeypatch.setattr(GPT, "compile", lambda self, **kwargs: calls.append(kwargs))
    cfg = load_config(None, ["model=tiny", "train.compile=true", *settings])
    validate(cfg, 1)
    build_model(cfg, ParallelState())
    assert calls == [expected]


@pytest.mark.unit
@pytest.mark.parametrize("settings, message", [
    (["train.compile_mode=max-autotune"],
     r"^train\.compile_mode=max-autotune needs train\.compile=true"),
    (["train.compile=true", "train.compile_mode=reduce-overhead",
      "train.compile_options={coordinate_descent_tuning: true}"],
     r"torch\.compile takes a mode or options, not both; .*\{triton\.cudagraphs: true\}"),
    (["train.compile=true", "train.compile_options={triton: {cuda_graphs: true}}"],
     r"^train\.compile_options: triton\.cuda_graphs is not an inductor setting of torch"),
])
def test_compile_settings_are_checked_before_any_work(settings, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, ["model=tiny", *settings]), 1)
