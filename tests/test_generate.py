"""Generation: the KV cache changes nothing, nor does TP, nor pipeline stages, nor batching
with left padding."""
import functools
import io
from contextlib import redirect_stdout

import pytest
import torch

from megalite.config import ParallelConfig
from megalite.generate import generate, main, pick
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from tests.support.generation import PROMPTS, check_cache_and_batching
from tests.support.harness import DistributedFailure, run_distributed
from tests.support.models import CONFIGS, PAD_ID
from tests.support.runs import common, train_run


@pytest.fixture(scope="module")
def one_process():
    """check_cache_and_batching on one process, by layer count, each run once: what every
    layout must generate."""
    return functools.cache(lambda n_layers: check_cache_and_batching(1, n_layers=n_layers))


@pytest.mark.unit
def test_cache_and_batching_single_process(one_process):
    one_process(2)


@pytest.mark.exactness
def test_generation_at_tp2_equals_tp1(one_process):
    single = one_process(2)
    assert run_distributed(check_cache_and_batching, 2, 2) == [single, single]


# With sequence parallelism, the prompt's forward without a cache runs on sequence shards, the
# cached decoding steps on whole (one-token) sequences: the stages must agree on which.
@pytest.mark.exactness
@pytest.mark.parametrize("tp, sp, pipeline", [
    (1, False, ParallelConfig(pp=4)),
    (1, False, ParallelConfig(pp=2, pp_schedule="interleaved", virtual_stages=2)),
    (2, True, ParallelConfig(tp=2, pp=2, sequence_parallel=True)),
], ids=["pp4", "pp2-interleaved-v2", "tp2xpp2-sp"])
def test_generation_with_pipeline_stages_equals_one_process(one_process, tp, sp, pipeline):
    single = one_process(4)
    world = tp * pipeline.pp
    assert run_distributed(check_cache_and_batching, world, tp, sp, pipeline, 4) == [single] * world


@pytest.mark.unit
def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0, -2.0]]).log_softmax(-1).repeat(200, 1)
    g = torch.Generator().manual_seed(0)
    assert set(pick(logits, 1.0, 2, 1.0, g).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.64, 0.23, 0.09, ...: top-p 0.8 keeps the first two
    assert probs[0] < 0.8 < probs[:2].sum()
    assert set(pick(logits, 1.0, 0, 0.8, g).tolist()) == {0, 1}
    assert pick(logits[:1], 0.0, 0, 1.0, g).tolist() == [0]


@pytest.mark.unit
def test_each_row_stops_at_its_own_eos_and_bad_prompts_are_refused():
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


def generated(argv: list[str]) -> str:
    """What `megalite generate` prints."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@pytest.mark.e2e
def test_the_command_runs_stages_of_uneven_layer_counts(tmp_path, cache):
    run_dir = tmp_path / "run"
    train_run(1, common(cache, run_dir, "packed") + [
        "model.n_layers=3", "train.max_steps=2", "train.checkpoint_every=2"])
    argv = ["--ckpt", str(run_dir / "checkpoints" / "step_00000002"), "--prompt", "The",
            "--max-new-tokens", "6"]
    single = generated(argv)
    assert single.startswith("--- 'The'\nThe")
    with pytest.raises(DistributedFailure, match=r"model\.n_layers=3 does not split evenly .*--pp-layers"):
        run_distributed(generated, 2, argv + ["--pp", "2"], torchrun_env=True)
    staged = run_distributed(generated, 2, argv + ["--pp", "2", "--pp-layers", "2,1"], torchrun_env=True)
    assert single in staged and "" in staged  # printed once, the same text
