"""The loop around the step: batches prefetched in a thread, checkpoints written in a thread.

The prefetched loop trains exactly as loading each step in turn; a failing load surfaces in
the loop; a background save is a snapshot of the step it was asked for, complete once
finished, and a failing write is raised on every rank with the earlier checkpoints intact.
"""
import threading

import pytest
import torch

from megalite import train as train_module
from megalite.data.batches import Prefetcher
from megalite.training import checkpoint
from megalite.training.optimizers.chained import ROWS
from megalite.training.checkpoint import CheckpointError, CheckpointWriter
from megalite.training.checkpoint_dirs import latest_checkpoint
from tests.support.checkpoints import WeightsOnly, fill_disk_of_rank_0, read_whole_state
from tests.support.harness import run_distributed
from tests.support.runs import InOrder, STEPS, common, losses


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("megalite-prefetch")]


@pytest.mark.unit
def test_prefetcher_loads_each_step_once_in_order_one_step_ahead():
    loaded, seen = [], []

    def load(step):
        loaded.append((step, threading.get_ident()))
        return [step * 10]

    with Prefetcher(load, range(3, 8)) as steps:
        for step, batches in steps:
            seen.append((step, batches, len(loaded)))
    assert [(s, b) for s, b, _ in seen] == [(s, [s * 10]) for s in range(3, 8)]
    assert [s for s, _ in loaded] == list(range(3, 8))
    assert all(ident != threading.get_ident() for _, ident in loaded)
    # When the loop gets step k, step k + 1 is already asked for (done by the end of the body).
    assert all(n >= i + 1 for i, (_, _, n) in enumerate(seen))
    assert not prefetch_threads()


@pytest.mark.unit
def test_an_error_in_the_prefetch_thread_is_raised_in_the_loop_at_its_step():
    def load(step):
        if step == 5:
            raise ValueError("corrupt sample")
        return step

    seen = []
    with pytest.raises(ValueError, match="corrupt sample"):
        with Prefetcher(load, range(10)) as steps:
            for step, _ in steps:
                seen.append(step)
    assert seen == [0, 1, 2, 3, 4]
    assert not prefetch_threads()


@pytest.mark.unit
def test_leaving_the_loop_early_stops_the_thread():
    loaded = []
    with pytest.raises(KeyboardInterrupt):
        with Prefetcher(loaded.append, range(100)) as steps:
            for step, _ in steps:
                if step == 2:
                    raise KeyboardInterrupt  # a preemption or an error in the step
    assert loaded in ([0, 1, 2], [0, 1, 2, 3])  # one step ahead at most (or cancelled unstarted)
    assert not prefetch_threads()


@pytest.mark.exactness
def test_prefetched_training_equals_training_without_prefetch(tmp_path, cache, monkeypatch):
    argv = common(cache, tmp_path / "prefetched", "packed") + ["parallel.tp=1"]
    assert train_module.main(argv) == 0
    monkeypatch.setattr(train_module, "Prefetcher", InOrder)
    assert train_module.main(common(cache, tmp_path / "in_order", "packed") + ["parallel.tp=1"]) == 0
    for key in ("loss", "grad_norm", "tokens"):
        assert losses(tmp_path / "prefetched", key) == losses(tmp_path / "in_order", key), key
    final = f"checkpoints/step_{STEPS:08d}"
    a, b = (read_whole_state(tmp_path / run / final) for run in ("prefetched", "in_order"))
    assert all(torch.equal(a[name], b[name]) for name in a)


def tiny_model(ps):
    from megalite.model import GPT
    from tests.support.models import CONFIGS
    return GPT(CONFIGS["gpt2"], ps, seed=0)


@pytest.mark.unit
def test_a_background_save_is_a_snapshot_complete_once_finished(tmp_path, monkeypatch):
    """Training goes on (here: the weights change) while the files are written; the
    checkpoint holds the weights of the step it was asked for, and appears, with the older
    ones pruned to `keep`, only once complete."""
    from megalite.parallel.state import ParallelState
    from megalite.training.checkpoint import load_checkpoint
    ps = ParallelState()
    model = tiny_model(ps)
    rng = {"cpu": torch.get_rng_state()}
    original, release = checkpoint.save_pieces, threading.Event()

    def slow_save_pieces(*args):
        assert release.wait(timeout=30)
        original(*args)

    with CheckpointWriter(ps) as writer:
        writer.save(tmp_path, 1, model, WeightsOnly(), rng, {}, keep=1)
        writer.finish()
        monkeypatch.setattr(checkpoint, "save_pieces", slow_save_pieces)
        expected = {n: p.detach().clone() for n, p in model.named_parameters()}
        writer.save(tmp_path, 2, model, WeightsOnly(), rng, {}, keep=1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the next optimizer step, while the write waits
        assert latest_checkpoint(tmp_path).name == "step_00000001"
        release.set()
        writer.finish()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    loaded = tiny_model(ps)
    meta, _ = load_checkpoint(latest_checkpoint(tmp_path), loaded, ps)
    assert meta["step"] == 2
    assert all(torch.equal(p, expected[n]) for n, p in loaded.named_parameters())


def check_background_write_failing_on_rank_0(tmp):
    """Rank 0's disk fills during the background write of step 2: the ranks learn it at the
    next agreement, all of them together, and step 1 stays the latest, complete."""
    from megalite.parallel.state import ParallelState
    ps = ParallelState.from_world(2)
    model = tiny_model(ps)

    class WithMoments(WeightsOnly):
        def optimizer_state(self, p):
            return {"exp_avg": p.detach()}

        def states(self, p):
            return {"exp_avg": ROWS}

    with CheckpointWriter(ps) as writer:
        writer.save(tmp, 1, model, WeightsOnly(), {"x": torch.zeros(1)}, {}, 3)
        writer.finish()
        fill_disk_of_rank_0(lambda key: key.startswith("optimizer/"))
        writer.save(tmp, 2, model, WithMoments(), {"x": torch.zeros(1)}, {}, 3)
        try:
            writer.finish()
        except CheckpointError as err:
            return str(err), latest_checkpoint(tmp).name
    return "no error", None


@pytest.mark.e2e
def test_a_failing_background_write_is_raised_on_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    (r0, latest0), (r1, latest1) = run_distributed(check_background_write_failing_on_rank_0, 2,
                                                   tmp_path, timeout=60)
    assert r0 == r1 and "failed on rank 0: [Errno 28] No space left on device (the disk is full" in r0
    assert latest0 == latest1 == "step_00000001"
    assert read_whole_state(tmp_path / "checkpoints" / "step_00000001")
