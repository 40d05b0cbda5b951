"""Fixtures shared across test modules (built once per session), and the `deepspeed` mark."""
import contextlib
import importlib.util
import json
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
