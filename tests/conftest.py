"""Fixtures shared across test modules: built once per session."""
import pytest

# The files that take longest (launch-level runs: Slurm, README, bench, real torchrun) start
# first, so that pytest-xdist's two workers, handed whole files in order, end together.
LONGEST_FIRST = ("test_slurm.py", "test_bench.py", "test_readme.py", "test_gpu_check.py",
                 "test_resume.py", "test_sharded_checkpoint.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """One tokenized-data cache for every training test (same corpus and tokenizer settings)."""
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture(scope="session")
def tp2dp2_padded(tmp_path_factory, cache):
    """The TP=2 x DP=2 training run of tests/test_train.py (padded, 2 micro-batches per step),
    with a checkpoint at step 5: the reference of the trainer, DeepSpeed and resharding tests."""
    from tests.test_train import LAYOUT, common, train_run
    run_dir = tmp_path_factory.mktemp("tp2dp2-padded")
    train_run(4, common(cache, run_dir, "padded") + LAYOUT + ["train.checkpoint_every=5"])
    return run_dir
