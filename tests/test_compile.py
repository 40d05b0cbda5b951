"""train.compile: torch.compile of the transformer blocks computes the same loss and gradients
as eager, at TP=1 and TP=2. The graphs are captured with the aot_eager backend, which traces
the blocks (dynamo and AOT autograd, as in production) without generating kernels, to keep
the test fast on CPU; inductor's kernels are measured by the GPU benchmarks."""
import torch

from megalite.model import GPT
from megalite.parallel.state import ParallelState
from tests.harness import run_distributed
from tests.models import CONFIGS, padded_batch


def check_compiled_blocks_match_eager(tp: int, name: str) -> None:
    ps = ParallelState.from_world(tp) if tp > 1 else ParallelState()
    cfg = CONFIGS[name]
    ids, mask, labels = padded_batch(cfg, "right")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    results = []
    for compiled in (False, True):
        model = GPT(cfg, ps, seed=3)
        if compiled:
            model.compile_blocks(backend="aot_eager")
        loss = model(ids, labels=labels).token_losses.sum()
        loss.backward()
        # Both models have this rank's slices: compare them as they are.
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    # Dynamo did capture graphs (a no-op compile_blocks would pass the comparison below).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-5, rtol=1e-5)
    assert eager_grads.keys() == compiled_grads.keys()
    for key in eager_grads:
        torch.testing.assert_close(compiled_grads[key], eager_grads[key], atol=1e-5, rtol=1e-5,
                                   msg=key)


def test_compiled_blocks_match_eager_single_process():
    check_compiled_blocks_match_eager(1, "llama")


def test_compiled_blocks_match_eager_at_tp2():
    run_distributed(check_compiled_blocks_match_eager, 2, 2, "gpt2")
