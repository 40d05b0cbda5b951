"""Fixtures shared across test modules (built once per session), the `deepspeed` mark, and the
tiers (pyproject.toml's markers): every test is `unit`, `exactness` or `e2e`
(tests/test_suite_rules.py checks that each has exactly one), and a unit test that starts a
process (a process group, a subprocess, a multiprocessing or torch.multiprocessing process)
fails with an error that says so."""
import contextlib
import functools
import importlib.util
import json
import multiprocessing.process
import shutil
import subprocess
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
    """As megalite's deepspeed_problems decides it: no module spec to import."""
    return importlib.util.find_spec("deepspeed") is None


def pytest_collection_modifyitems(config, items):
    if deepspeed_missing():  # README's quick start does not install it; .ci/run does
        for item in items:
            if item.get_closest_marker("deepspeed"):
                item.add_marker(pytest.mark.skip(reason=DEEPSPEED_MISSING))


TIERS = ("unit", "exactness", "e2e")
UNIT_STARTS_NO_PROCESS = "a unit test starts no process: mark it exactness or e2e"
_unit_test: list[str] = []  # the unit test running now (its node id), while one runs
_refused: list[str] = []  # the starts it was refused (kept: the code under test may catch them)


class UnitTestStartedAProcess(RuntimeError):
    pass


def refused_in_unit_tests(start, what: str):
    """`start` as it was, but raising UnitTestStartedAProcess while a unit test runs."""
    @functools.wraps(start)
    def guarded(*args, **kwargs):
        if _unit_test:
            _refused.append(f"{_unit_test[0]} {what}: {UNIT_STARTS_NO_PROCESS}")
            raise UnitTestStartedAProcess(_refused[-1])
        return start(*args, **kwargs)
    guarded.refused_in_unit_tests = True
    return guarded


def guard(owner, name: str, what: str) -> None:
    start = getattr(owner, name)
    if not getattr(start, "refused_in_unit_tests", False):
        setattr(owner, name, refused_in_unit_tests(start, what))


def guard_process_starts() -> None:
    """Every way a test starts another process, refused while a unit test runs: once per session
    (subprocess.Popen's child, whatever module named it; every multiprocessing and
    torch.multiprocessing process; a torch.distributed process group). First, what runs a
    subprocess once to fill a cache: matplotlib's font list (fc-list, on a fresh machine)."""
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401
    guard(subprocess.Popen, "_execute_child", "started a subprocess (subprocess.Popen)")
    guard(multiprocessing.process.BaseProcess, "start", "started a process (multiprocessing)")
    import torch.distributed as dist
    if dist.is_available():
        what = "started a process group (torch.distributed.init_process_group)"
        guard(dist, "init_process_group", what)
        guard(dist.distributed_c10d, "init_process_group", what)


@contextlib.contextmanager
def unit_runs(item):
    """While a unit test's fixtures are set up and while it runs: a process start raises."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    guard_process_starts()
    _unit_test.append(item.nodeid)
    try:
        yield
        if _refused:  # raised, and caught by the code under test
            raise UnitTestStartedAProcess(_refused[0])
    finally:
        _unit_test.clear()
        _refused.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with unit_runs(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with unit_runs(item):
        return (yield)


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
    from tests.support.runs import LAYOUT, common, train_run
    run_dir, done = shared / "tp2dp2-padded", shared / "tp2dp2-padded.done"
    with waiting_for(shared / "tp2dp2-padded.lock", "tp2dp2_padded"):
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            train_run(4, common(cache, run_dir, "padded") + LAYOUT + ["train.checkpoint_every=5"])
            done.touch()
    return run_dir


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache):
    """The one-process run of some settings on padded or packed rows, made once a module
    (tests/test_architectures_train.py, tests/test_deepseek_train.py; modules whose one-process
    run takes other arguments have a `single` of their own)."""
    from tests.support.runs import common, one_process_runs
    runs = one_process_runs(tmp_path_factory)

    def run(settings: list[str], mode: str):
        return runs((*settings, mode), lambda run_dir: common(cache, run_dir, mode) + settings
                    + ["parallel.tp=1", "train.micro_batch_size=8"], f"single-{mode}")
    return run


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE with the chat templates' special tokens (tests/support/chat.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.support.chat import CONVERSATIONS, SPECIAL
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["system user assistant helpful"]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    """A model directory of `tokenizer` whose chat template refuses tool turns."""
    from tests.support.chat import REFUSING
    directory = tmp_path / "model"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": REFUSING}))
    return directory


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """The Hugging Face tests' tokenizer.json: VOCAB tokens (tests/support/hf.py)."""
    from megalite.data.tokenizer import train_bpe
    from tests.support.hf import VOCAB
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(["tensor parallel training of language models " * 20], VOCAB).save(str(path))
    return path


@pytest.fixture(scope="module")
def hf_tokenizers(tmp_path_factory):
    """Each standard tokenizer shape's Hugging Face directory (tests/support/tokenizer_shapes.py)."""
    from tests.support.tokenizer_shapes import SHAPES
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: build(root / name) for name, build in SHAPES.items()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 40 embedded documents as jsonl (tests/support/tokenizer_shapes.py)."""
    from tests.support.tokenizer_shapes import write_corpus
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


@pytest.fixture
def no_tf32():
    """fp32 matmuls and convolutions in full fp32: TF32 keeps 10 mantissa bits (~5e-4 relative
    per product), above every fp32 tolerance of the GPU tests, which use this fixture. Put back
    after each test."""
    import torch
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


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
