"""The trainer: any TP x DP x accumulation layout trains the same model, step for step.

Runs megalite.train.main on gloo processes given torchrun's environment, on the embedded corpus
with a small tokenizer, and compares the per-step losses in metrics.jsonl and the final weights.
"""

import numpy as np
import pytest
import torch

from megalite import train as train_module
from megalite.prep.command import prepare_for_run
from megalite.run_config import load_config
from megalite.training.metrics import read_records
from tests.support.checkpoints import read_whole_state
from tests.support.harness import run_distributed

STEPS = 10
LAYOUT = ["parallel.tp=2", "train.micro_batch_size=2"]  # with a global batch of 8: DP=2, 2 micro-batches


def common(cache: str, run_dir, mode: str) -> list[str]:
    # Padded rows of 160 tokens: about one document in 12 of the embedded corpus is shorter, so
    # about half the steps have padded rows and the DP ranks' real tokens differ (at 32 tokens
    # no document is short enough to pad).
    rows = ["data.seq_len=160", "model.max_seq_len=160"] if mode == "padded" else ["data.seq_len=32"]
    return ["model=tiny", "model.hidden=32", "model.dropout=0.0", f"data.mode={mode}", *rows,
            "data.bpe_vocab_size=512", f"data.cache_dir={cache}",
            f"train.max_steps={STEPS}", "train.global_batch_size=8", "train.warmup_steps=3",
            # padded: the whole held-out set; packed: its first 8 samples of 32.
            f"train.eval_tokens={0 if mode == 'padded' else 256}",
            "sample.prompts=[The]", "sample.max_new_tokens=4",
            # Below the gradient norm (~0.3 to 0.6), so clipping acts at every step.
            "train.grad_clip=0.1",
            f"run.dir={run_dir}"]


def run_train(argv: list[str]) -> int:
    """The trainer in this process, on one thread as each torchrun rank has; the thread count
    is put back after, since later tests in this process have numerics that depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_module.main(argv)
    finally:
        torch.set_num_threads(threads)


def train_run(world: int, argv: list[str]) -> None:
    if world == 1:
        assert run_train(argv) == 0
    else:
        assert run_distributed(run_train, world, argv, torchrun_env=True) == [0] * world


def losses(run_dir, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_records(run_dir / "metrics.jsonl") if key in r}


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return read_whole_state(run_dir / "checkpoints" / f"step_{STEPS:08d}")


def assert_same_training(a, b, tol=1e-5, learns=True, weights_tol=None):
    """learns=False: data with nothing to learn (random ids), where only agreement is asked.
    weights_tol: the final weights' tolerance, where not tol."""
    la, lb = losses(a), losses(b)
    assert sorted(la) == list(range(1, STEPS + 1)) and sorted(lb) == sorted(la)
    for step in la:
        assert abs(la[step] - lb[step]) <= tol * max(1.0, abs(la[step])), (step, la[step], lb[step])
    assert la[STEPS] < la[1] - 0.1 or not learns
    na, nb = losses(a, "grad_norm"), losses(b, "grad_norm")
    assert min(na.values()) > 0.1  # clipping was active
    for step in na:
        assert abs(na[step] - nb[step]) <= tol * max(1.0, na[step]), (step, na[step], nb[step])
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=weights_tol or tol,
                                   rtol=weights_tol or tol, msg=name)


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
