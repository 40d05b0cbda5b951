"""Fixtures shared across test modules: built once per session."""
import shutil
from pathlib import Path

import pytest
from filelock import FileLock


@pytest.fixture(scope="session")
def shared(tmp_path_factory, request) -> Path:
    """A directory that every pytest-xdist worker of this session sees (without xdist, or where
    it is not installed, as on a GPU machine's own Python: this process's own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(request.config, "workerinput") else base


@pytest.fixture(scope="session")
def cache(shared):
    """One tokenized-data cache for every training test (same corpus and tokenizer settings),
    shared by the workers as runs share a data.cache_dir: the first to need an entry builds it
    under megalite's lock, the others wait and read it."""
    path = shared / "data-cache"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def tp2dp2_padded(shared, cache):
    """The TP=2 x DP=2 training run of tests/test_train.py (padded, 2 micro-batches per step),
    with a checkpoint at step 5: the reference of the trainer, DeepSpeed and resharding tests.
    Run once per session: the first worker to ask trains it, the others wait for it."""
    from tests.test_train import LAYOUT, common, train_run
    run_dir, done = shared / "tp2dp2-padded", shared / "tp2dp2-padded.done"
    with FileLock(shared / "tp2dp2-padded.lock"):
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            train_run(4, common(cache, run_dir, "padded") + LAYOUT + ["train.checkpoint_every=5"])
            done.touch()
    return run_dir
