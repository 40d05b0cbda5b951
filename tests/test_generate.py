"""Generation with the KV cache equals generation that recomputes the whole prefix, at TP=1 and 2."""
import torch

from megalite.generate import generate
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from tests.harness import run_distributed
from tests.models import CONFIGS


def check_cache_equals_recompute(tp: int):
    ps = ParallelState.from_world(tp) if tp > 1 else ParallelState()
    results = []
    for cfg in CONFIGS.values():
        model = GPT(cfg, ps, seed=3)
        prompt = [7, 3, 9, 1]
        for temperature, top_k in ((0.0, 0), (0.9, 5)):
            cached = generate(model, prompt, 12, temperature=temperature, top_k=top_k, seed=1)
            full = generate(model, prompt, 12, temperature=temperature, top_k=top_k, seed=1,
                            use_cache=False)
            assert cached == full, (cached, full)
            assert cached[:4] == prompt and len(cached) == 16
            results.append(cached)
    return results


def test_kv_cache_generation_equals_recompute_single_process():
    check_cache_equals_recompute(1)


def test_kv_cache_generation_at_tp2_equals_tp1():
    single = check_cache_equals_recompute(1)
    assert run_distributed(check_cache_equals_recompute, 2, 2) == [single, single]
