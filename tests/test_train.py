"""The trainer: any TP x DP x accumulation layout trains the same model, step for step.

Runs megalite.train.main on gloo processes given torchrun's environment, on the embedded corpus
with a small tokenizer, and compares the per-step losses in metrics.jsonl and the final weights.
"""

import numpy as np
import pytest

from megalite.prep.command import prepare_for_run
from megalite.run_config import load_config
from tests.support.runs import LAYOUT, STEPS, assert_same_training, common, losses, train_run

pytestmark = pytest.mark.exactness


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_tp2_dp2_trains_like_one_process(tmp_path, cache, mode, request):
    single, layout = tmp_path / "single", tmp_path / "tp2dp2"
    train_run(1, common(cache, single, mode) + ["parallel.tp=1", "train.micro_batch_size=8"])
    if mode == "padded":  # the session's run (conftest.py), also the DeepSpeed tests' reference
        layout = request.getfixturevalue("tp2dp2_padded")
    else:
        train_run(4, common(cache, layout, mode) + LAYOUT)
    assert_same_training(single, layout)
    assert losses(single, "val_tokens") == losses(layout, "val_tokens") == {
        STEPS: held_out_targets(cache, mode)}


def held_out_targets(cache, mode: str) -> int:
    """The target tokens validation should see, counted from the prepared data: padded, every
    held-out document's first seq_len + 1 tokens; packed, the first 8 rows of the held-out
    stream, where a token's successor is of the same document."""
    cfg = load_config(None, common(cache, "unused", mode))
    (val,) = prepare_for_run(cfg.data).val
    seq = cfg.data.seq_len
    if mode == "padded":
        lengths = val.docs.lengths(np.arange(len(val.docs)))
        return int((np.minimum(lengths, seq + 1) - 1).sum())
    _, docs = val.docs.window(np.arange(8) * seq, seq + 1)
    return int((docs[:, 1:] == docs[:, :-1]).sum())


def test_dp2_with_accumulation_2_equals_dp1_with_accumulation_4(tmp_path, cache):
    dp1, dp2 = tmp_path / "dp1acc4", tmp_path / "dp2acc2"
    train_run(1, common(cache, dp1, "padded") + ["train.micro_batch_size=2"])
    train_run(2, common(cache, dp2, "padded") + ["train.micro_batch_size=2"])
    assert_same_training(dp1, dp2)
