"""A checkpoint written at one TP x DP layout loads at any other and training continues."""
import pytest
from torch.testing import assert_close

from megalite.model import GPT
from megalite.parallel.state import ParallelState
from megalite.run_config import load_config
from megalite.training.checkpoint import load_checkpoint
from tests.support.harness import run_distributed
from tests.support.models import padded_batch
from tests.support.resume import SAVED_AT, resume_and_compare
from tests.support.runs import STEPS, common, losses, train_run

pytestmark = pytest.mark.exactness


def check_logits_at(tp: int, checkpoint_dir: str, config_path: str):
    cfg = load_config(config_path)
    ps = ParallelState.from_world(tp) if tp > 1 else ParallelState()
    model = GPT(cfg.model, ps, seed=99)  # a different init, entirely overwritten by the load
    load_checkpoint(checkpoint_dir, model, ps)
    ids, mask, _ = padded_batch(cfg.model, "left")
    return model.full_logits(model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("tp,world", [(4, 4), (1, 1)])
def test_tp2dp2_checkpoint_loads_and_continues_at_another_layout(tmp_path, cache, tp2dp2_padded,
                                                                 tp, world, capsys):
    """The original: conftest.py's TP=2 x DP=2 run, 10 steps, checkpointed at step 5."""
    run_dir = tp2dp2_padded
    checkpoint = run_dir / "checkpoints" / f"step_{SAVED_AT:08d}"
    config = str(run_dir / "config.yaml")
    saved = run_distributed(check_logits_at, 2, 2, str(checkpoint), config)[0]
    here = (check_logits_at(tp, str(checkpoint), config) if world == 1
            else run_distributed(check_logits_at, world, tp, str(checkpoint), config)[0])
    assert_close(here, saved, atol=1e-6, rtol=1e-6)

    resume_and_compare(cache, run_dir, checkpoint, tmp_path / f"tp{tp}", world, tp)
    if world == 1:  # in this process: its output is captured
        out = capsys.readouterr().out
        assert f"resumed from {checkpoint} at step {SAVED_AT}\n" in out
        assert "layout: saved at TP2 x CP1 x PP1 x DP2, now TP1 x CP1 x PP1 x DP1" in out
        assert f"cosine to 0.0001 at step {STEPS}\n" in out


def test_a_resume_with_more_steps_keeps_the_decay_unless_asked(tmp_path, cache, tp2dp2_padded):
    """Raising max_steps on resume: the original schedule, then min_lr (no jump back up);
    train.decay_steps=max_steps stretches the cosine over the new length."""
    checkpoint = tp2dp2_padded / "checkpoints" / f"step_{SAVED_AT:08d}"
    longer = STEPS + 3
    for run, extra in (("kept", ()), ("stretched", (f"train.decay_steps={longer}",))):
        train_run(1, common(cache, tmp_path / run, "padded") + [
            "parallel.tp=1", "train.micro_batch_size=8", f"train.resume={checkpoint}",
            f"train.max_steps={longer}", *extra])
    original, kept, stretched = (losses(d, "lr") for d in (tp2dp2_padded, tmp_path / "kept",
                                                            tmp_path / "stretched"))
    assert sorted(kept) == list(range(SAVED_AT + 1, longer + 1))
    assert all(kept[s] == original[s] for s in range(SAVED_AT + 1, STEPS + 1))
    assert all(kept[s] == 1e-4 for s in range(STEPS + 1, longer + 1))  # common()'s min_lr
    assert all(stretched[s] > original[s] for s in range(SAVED_AT + 1, STEPS + 1))


