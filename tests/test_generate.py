"""Generation: the KV cache changes nothing, nor does TP, nor batching with left padding."""
import torch

from megalite.generate import generate, pick
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from tests.harness import run_distributed
from tests.models import CONFIGS, PAD_ID

PROMPTS = [[7, 3, 9, 1], [4, 4], [11, 2, 8, 6, 5, 13]]


def check_cache_and_batching(tp: int, sequence_parallel: bool = False):
    ps = ParallelState.from_world(tp, sequence_parallel=sequence_parallel) if tp > 1 else ParallelState()
    results = []
    for cfg in CONFIGS.values():
        model = GPT(cfg, ps, seed=3)
        for temperature, top_k, top_p in ((0.0, 0, 1.0), (0.9, 5, 0.9)):
            kw = dict(pad_id=PAD_ID, temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
            cached = generate(model, PROMPTS[:1], 12, **kw)
            assert cached == generate(model, PROMPTS[:1], 12, use_cache=False, **kw)
            assert len(cached[0]) == 12
            results.append(cached)
        # Left-padded batch, greedy: each row as if generated alone.
        batched = generate(model, PROMPTS, 10, pad_id=PAD_ID)
        assert batched == [generate(model, [p], 10, pad_id=PAD_ID)[0] for p in PROMPTS]
        assert batched == generate(model, PROMPTS, 10, pad_id=PAD_ID, use_cache=False)
        results.append(batched)
    return results


def test_cache_and_batching_single_process():
    check_cache_and_batching(1)


def test_generation_at_tp2_equals_tp1():
    single = check_cache_and_batching(1)
    assert run_distributed(check_cache_and_batching, 2, 2) == [single, single]


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0, -2.0]]).log_softmax(-1).repeat(200, 1)
    g = torch.Generator().manual_seed(0)
    assert set(pick(logits, 1.0, 2, 1.0, g).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.23, 0.09, ...: top-p 0.8 keeps the first two
    assert probs[0] < 0.8 < probs[:2].sum()
    assert set(pick(logits, 1.0, 0, 0.8, g).tolist()) == {0, 1}
    assert pick(logits[:1], 0.0, 0, 1.0, g).tolist() == [0]


def test_each_row_stops_at_its_own_eos_and_bad_prompts_are_refused():
    import pytest
    model = GPT(CONFIGS["gpt2"], ParallelState(), seed=3)
    free = generate(model, PROMPTS, 8, pad_id=PAD_ID)
    eos = free[0][2]  # make the first row's third new token the end of its document
    stopped = generate(model, PROMPTS, 8, pad_id=PAD_ID, eos_id=eos)
    for row in range(len(PROMPTS)):  # cut after its first eos, the other rows carrying on
        assert stopped[row] == (free[row][:free[row].index(eos) + 1] if eos in free[row] else free[row])
    assert len(stopped[0]) <= 3
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        generate(model, [[]], 4, pad_id=PAD_ID)
    with pytest.raises(ValueError, match="no room to generate"):
        generate(model, [[1] * model.cfg.max_seq_len], 4, pad_id=PAD_ID)
    with pytest.raises(ValueError, match=r"top_p=0.0 must be in \(0, 1\]"):
        generate(model, PROMPTS, 4, pad_id=PAD_ID, temperature=1.0, top_p=0.0)
