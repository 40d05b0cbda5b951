"""The objective as a seam (train.objective): a test objective that is not token cross-entropy,
a sequence-level loss over pairs of rows (tests/support/pairs.py), trains at TP2 x DP2, PP2 x
DP2 and CP2 x DP2, with two micro-batches per rank, as one process does on the whole batch
(fp32, 1e-5: losses, gradient norms, final weights): the pairs stay together on one rank, a
row's score is summed over its CP shares, and the denominator is the global batch's pairs.
In one process, its loss and gradients through the pipeline runner, in micro-batches, are
the pair loss written out on the whole batch; the order keeps each pair's rows together; the
plan refuses micro-batches that would cut a pair and an objective it cannot find."""
import numpy as np
import pytest
import torch
from torch.testing import assert_close

from megalite.data.batches import Batch, BatchOrder
from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.pipeline.runner import train_pipelined
from megalite.plan import validate
from megalite.run_config import TrainConfig, load_config
from megalite.training.engine import NativeEngine
from megalite.typed_config import ConfigError
from tests.support.models import CONFIGS
from tests.support.pairs import PairPreference, pair_loss
from tests.support.runs import LLAMA, assert_same_training, common, train_run

PAIRS = ["train.objective=tests.support.pairs:PairPreference"]
LAYOUTS = {"tp2-dp2": ["parallel.tp=2"], "pp2-dp2": ["parallel.pp=2"], "cp2-dp2": ["parallel.cp=2"]}


@pytest.mark.unit
def test_the_runner_gives_the_pair_loss_and_its_gradients_in_micro_batches():
    cfg, ps = CONFIGS["llama"], ParallelState()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (8, 16), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((8, 1), -100)], dim=1)
    labels[:, :5] = -100  # prompt tokens, as SFT marks them
    expected = GPT(cfg, ps, seed=1)
    want = pair_loss(expected(ids, labels=labels).token_losses)
    want.backward()
    model = GPT(cfg, ps, seed=1)
    engine = NativeEngine(model, TrainConfig(precision="fp32"), ps)
    micro = [Batch(input_ids=ids[i:i + 2], labels=labels[i:i + 2]) for i in range(0, 8, 2)]
    n_tokens = (labels != -100).sum().float()
    loss = train_pipelined(engine, micro, n_tokens, torch.autocast("cpu", enabled=False), "1f1b",
                           PairPreference())
    engine.grad_sync.wait()
    assert_close(loss, want.detach(), atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), expected.parameters()):
        assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.unit
def test_the_order_keeps_groups_whole_and_is_todays_for_single_rows():
    sizes, weights = [10, 7], [0.5, 0.5]
    for step in range(3):
        picks = BatchOrder(sizes, weights, 8, seed=4, group_rows=2).global_batch_picks(step)
        pairs = picks.reshape(-1, 2, 2)
        assert (pairs[:, 0, 0] == pairs[:, 1, 0]).all()  # one source
        assert (pairs[:, 0, 1] % 2 == 0).all() and (pairs[:, 1, 1] == pairs[:, 0, 1] + 1).all()
        assert (picks[:, 1] < np.asarray(sizes)[picks[:, 0]] // 2 * 2).all()
    # Groups of one are the samples, in the order checkpoints record (SAMPLE_ORDER).
    single = BatchOrder(sizes, weights, 8, seed=4)
    assert single.global_batch_picks(1).tolist() == single.picks(np.arange(8, 16)).tolist()


@pytest.mark.unit
def test_the_plan_refuses_a_micro_batch_that_cuts_a_pair_and_an_unknown_objective():
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=3 with train\.objective=tests\.support"
                                          r"\.pairs:PairPreference: its rows come in groups of 2.*multiple of 2"):
        validate(load_config(None, PAIRS + ["train.micro_batch_size=3", "train.global_batch_size=9"]), 1)
    with pytest.raises(ConfigError, match=r"train\.objective='dpo' is neither one of \['lm'\]"):
        validate(load_config(None, ["train.objective=dpo"]), 1)
    validate(load_config(None, PAIRS + ["train.micro_batch_size=4"]), 1)


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("pairs-single")
    train_run(1, common(cache, run_dir, "packed") + LLAMA + PAIRS
              + ["parallel.tp=1", "train.micro_batch_size=8", "model.n_layers=4"])
    return run_dir


@pytest.mark.exactness
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_pair_objective_trains_like_one_process(tmp_path, cache, single, layout):
    train_run(4, common(cache, tmp_path, "packed") + LLAMA + PAIRS + LAYOUTS[layout]
              + ["train.micro_batch_size=2", "model.n_layers=4"])
    # Random pairs of the corpus's rows: nothing to learn, only agreement to show.
    assert_same_training(single, tmp_path, learns=False)
