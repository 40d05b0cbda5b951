"""Generation's checks: KV-cache generation equals the uncached one, and a left-padded batch
equals each row generated alone; its results, which every layout must equal."""
import dataclasses

from megalite.config import ParallelConfig
from megalite.generate import generate
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from tests.support.models import CONFIGS, PAD_ID


PROMPTS = [[7, 3, 9, 1], [4, 4], [11, 2, 8, 6, 5, 13]]
NEW = 6  # tokens per generation: the prompt's forward, then 5 decoding steps off the cache


def check_cache_and_batching(tp: int, sequence_parallel: bool = False,
                             pipeline: ParallelConfig | None = None, n_layers: int = 2):
    distributed = tp > 1 or pipeline is not None
    ps = ParallelState.from_world(tp, pipeline=pipeline) if distributed else ParallelState()
    layout = dataclasses.replace(pipeline or ParallelConfig(), tp=tp, sequence_parallel=sequence_parallel)
    results = []
    for cfg in CONFIGS.values():
        model = GPT(dataclasses.replace(cfg, n_layers=n_layers), ps, seed=3, parallel=layout)
        for temperature, top_k, top_p in ((0.0, 0, 1.0), (0.9, 5, 0.9)):
            kw = dict(pad_id=PAD_ID, temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
            cached = generate(model, PROMPTS[:1], NEW, **kw)
            assert cached == generate(model, PROMPTS[:1], NEW, use_cache=False, **kw)
            assert len(cached[0]) == NEW
            results.append(cached)
        # Left-padded batch, greedy: each row as if generated alone.
        batched = generate(model, PROMPTS, NEW, pad_id=PAD_ID)
        assert batched == [generate(model, [p], NEW, pad_id=PAD_ID)[0] for p in PROMPTS]
        assert batched == generate(model, PROMPTS, NEW, pad_id=PAD_ID, use_cache=False)
        results.append(batched)
    return results
