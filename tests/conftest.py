"""Fixtures shared across test modules (built once per session), and the `deepspeed` mark."""
import contextlib
import importlib.util
import shutil
from pathlib import Path

import pytest
from filelock import FileLock, Timeout

# A worker waits this long for another's shared training run (about 1 to 2 minutes) to finish.
SHARED_RUN_WAIT_S = 15 * 60
DEEPSPEED_MISSING = ("needs the deepspeed package (pip install --no-build-isolation "
                     "'megalite[deepspeed]', after torch)")


def pytest_configure(config):
    config.addinivalue_line("markers", "deepspeed: trains with train.engine=deepspeed; skipped "
                            "where the deepspeed package is missing (tests/test_suite_rules.py "
                            "checks that every such test has it)")


def deepspeed_missing() -> bool:
    """As megalite's check_deepspeed decides it: no module spec to import."""
    return importlib.util.find_spec("deepspeed") is None


def pytest_collection_modifyitems(config, items):
    if deepspeed_missing():  # README's quick start does not install it; .ci/run does
        for item in items:
            if item.get_closest_marker("deepspeed"):
                item.add_marker(pytest.mark.skip(reason=DEEPSPEED_MISSING))


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
    with waiting_for(shared / "tp2dp2-padded.lock", "tp2dp2_padded"):
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            train_run(4, common(cache, run_dir, "padded") + LAYOUT + ["train.checkpoint_every=5"])
            done.touch()
    return run_dir


@contextlib.contextmanager
def waiting_for(path: Path, what: str):
    """FileLock(path), waited for at most SHARED_RUN_WAIT_S: the holder is another worker
    making `what`."""
    lock = FileLock(path, timeout=SHARED_RUN_WAIT_S)
    try:
        lock.acquire()
    except Timeout:
        pytest.fail(f"waited {SHARED_RUN_WAIT_S // 60} minutes for another pytest worker's {what} "
                    f"run (it holds {path}): that run is hung or far too slow", pytrace=False)
    try:
        yield
    finally:
        lock.release()
