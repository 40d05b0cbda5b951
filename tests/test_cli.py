"""The command line a new user meets: a misused command line and `--version`, a wrong --ckpt
answered with the path or command to use, files that follow the umask, and progress that suits
a log file (a Slurm job's output). (`megalite --help` and every command's defaults in its
--help, beside the measuring tools': tests/test_tools_cli.py.)"""
import gzip
import importlib.metadata
import itertools
import lzma
import os
import re
import stat
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from megalite import cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.unit
@pytest.mark.parametrize("argv", [[], ["trian"]])
def test_misuse_lists_the_commands_and_exits_2(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert all(f"  {name} " in err for name in cli.COMMANDS)
    if argv:
        assert "unknown command 'trian' (did you mean 'train'?)" in err


@pytest.mark.unit
def test_version_is_the_installed_packages(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"megalite {importlib.metadata.version('megalite')}\n"


def fake_run_dir(root):
    """A run directory as training leaves it: two complete checkpoints, one being written."""
    for step, complete in ((2, True), (4, True), (6, False)):
        step_dir = root / "checkpoints" / f"step_{step:08d}"
        step_dir.mkdir(parents=True)
        if complete:
            (step_dir / "meta.json").write_text("{}")
    return root / "checkpoints" / "step_00000004"


COMMANDS_WITH_CKPT = {"export": ["--to-hf", "out"], "eval": ["--text", "some.txt"],
                      "generate": ["--prompt", "The"]}


@pytest.mark.unit
@pytest.mark.parametrize("command", sorted(COMMANDS_WITH_CKPT))
def test_a_run_directory_given_as_ckpt_suggests_its_newest_checkpoint(tmp_path, capsys, command):
    newest = fake_run_dir(tmp_path / "run")
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        assert cli.main([command, "--ckpt", str(given), *COMMANDS_WITH_CKPT[command]]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"megalite: error: '{given}' is a ") and err.count("\n") == 1, err
        assert f"give its newest checkpoint, '{newest}'" in err


@pytest.mark.unit
@pytest.mark.parametrize("command", sorted(COMMANDS_WITH_CKPT))
def test_a_hugging_face_directory_given_as_ckpt_suggests_import(tmp_path, capsys, command):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert cli.main([command, "--ckpt", str(hf), *COMMANDS_WITH_CKPT[command]]) == 2
    assert f"make one of it first with `megalite import --from-hf {hf} --to CKPT`" in \
        capsys.readouterr().err


@contextmanager
def umask(mask: int):
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def assert_modes_follow_umask(root: Path, mask: int) -> None:
    """Every file 0666 & ~mask, every directory 0777 & ~mask: readable to colleagues at 022."""
    paths = [root, *root.rglob("*")]
    assert len(paths) > 3
    for path in paths:
        expected = (0o777 if path.is_dir() else 0o666) & ~mask
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(path.stat().st_mode))


@pytest.fixture(scope="module")
def run_logged_to_a_pipe(tmp_path_factory, cache):
    """A 6-step run with stdout to a pipe (as a Slurm job's log) under umask 022: (run dir,
    its stdout)."""
    from tests.support.runs import common
    run_dir = tmp_path_factory.mktemp("logged") / "run"
    argv = [sys.executable, "-m", "megalite.train", *common(cache, run_dir, "padded"), "parallel.tp=1",
            "train.micro_batch_size=8", "train.max_steps=6", "train.log_every=2",
            "train.eval_every=4", "train.eval_tokens=64", "train.checkpoint_every=0"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: os.umask(0o022))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir, done.stdout


@pytest.mark.e2e
def test_progress_in_a_log_file_is_a_line_per_logged_step(run_logged_to_a_pipe):
    _, out = run_logged_to_a_pipe
    assert "\r" not in out
    lines = out.splitlines()
    steps = [line for line in lines if re.match(r"step \d+/6: ", line)]
    assert [s.split(":")[0] for s in steps] == ["step 2/6", "step 4/6", "step 6/6"]
    assert all(re.fullmatch(r"step \d+/6: loss \d+\.\d{4}, lr \S+, tok/s [\d,]+, mfu -, mem \d+\.\d\d GiB", s) for s in steps)
    validations = [line for line in lines if "val_loss" in line]
    assert [v.split(":")[0] for v in validations] == ["step 4", "step 6"]
    assert all(v.startswith("step ") for v in validations)  # on a line of its own


@pytest.mark.e2e
def test_checkpoints_and_exports_follow_the_umask(run_logged_to_a_pipe, tmp_path):
    run_dir, _ = run_logged_to_a_pipe
    assert_modes_follow_umask(run_dir / "checkpoints", 0o022)
    from megalite.hf.convert import export_hf
    with umask(0o022):
        export_hf(run_dir / "checkpoints" / "step_00000006", tmp_path / "hf")
    assert_modes_follow_umask(tmp_path / "hf", 0o022)


@pytest.fixture(scope="module")
def small_gz(tmp_path_factory):
    """The first 300 documents of the embedded corpus as .jsonl.gz."""
    from megalite.data.raw_files import EMBEDDED
    with lzma.open(EMBEDDED) as f:
        text = b"".join(itertools.islice(f, 300))
    path = tmp_path_factory.mktemp("gz") / "docs.jsonl.gz"
    path.write_bytes(gzip.compress(text))
    return path, len(text)


@pytest.mark.unit
def test_reading_counts_the_text_as_decompressed(small_gz):
    from megalite.prep.sources import read_chunks
    path, text_bytes = small_gz
    chunks = list(read_chunks(path, "text"))
    assert sum(c.text_bytes() for c in chunks) == text_bytes
    assert chunks[-1].read_to == path.stat().st_size < text_bytes


@pytest.mark.unit
def test_prepare_data_in_a_log_file_announces_the_bpe_and_prints_lines(small_gz, tmp_path, capsys):
    path, _ = small_gz
    out = tmp_path / "bpe"
    with umask(0o022):
        assert cli.main(["prepare-data", "--input", str(path), "--out", str(out), "--workers", "0",
                         "--bpe-vocab-size", "300"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[0] == "prepare-data: training a byte-level BPE of 300 tokens on up to 100 MB of documents..."
    assert re.fullmatch(r"prepare-data: BPE trained on 300 documents in [\d.]+ s", lines[1])
    size = path.stat().st_size / 1e6
    assert re.fullmatch(rf"prepare: {size:.1f} of {size:.1f} MB of input read \(100%\): "
                        rf"[\d.]+ MB/s of text, [\d,]+ tok/s, 300 docs", lines[-1]), lines


@pytest.mark.unit
def test_prepared_data_follows_the_umask_whatever_the_tokenizers_mode(small_gz, tmp_path):
    from megalite.data.tokenizer import train_bpe
    path, _ = small_gz
    private = tmp_path / "private.json"  # a colleague's copy of it must still be readable
    train_bpe(["tensor parallel training of language models " * 20], 300).save(str(private))
    private.chmod(0o600)
    with umask(0o022):
        assert cli.main(["prepare-data", "--input", str(path), "--out", str(tmp_path / "prep"),
                         "--tokenizer", str(private), "--workers", "0"]) == 0
    assert_modes_follow_umask(tmp_path / "prep", 0o022)


# ---- torch's threads in a command that computes (cli.cap_threads) ----------------------------

# `megalite COMMAND ARGS` on a machine of 2 cores that other processes keep LOAD busy, with the
# command's module replaced by print_threads. (torch takes no more threads than the real cores.)
THREADS_PROBE = """import os, sys
os.sched_getaffinity = lambda pid: {0, 1}
os.getloadavg = lambda: (float(os.environ.pop("LOAD")), 0.0, 0.0)
from megalite import cli, command_args
cli.COMMANDS = {**cli.COMMANDS, sys.argv[1]: ("tests.test_cli", "print_threads", "")}
sys.exit(cli.main(sys.argv[1:]))
"""


def print_threads(argv) -> int:
    import torch
    print(torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))
    return 0


def threads_of(command: str, load: float, **env: str) -> str:
    """torch's threads in the command, and OMP_NUM_THREADS there."""
    from tests.support.launch import REQUIRED
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", THREADS_PROBE, command, *REQUIRED.get(command, [])],
                          cwd=ROOT, env={**clean, "LOAD": str(load), **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


COMPUTING = ("export", "import", "eval", "generate")


@pytest.mark.unit
def test_the_commands_that_compute():
    assert cli.COMPUTING == COMPUTING


@pytest.mark.unit
@pytest.mark.parametrize("cores,load,threads", [(2, 0.3, 2), (2, 0.6, 1), (2, 5.0, 1), (6, 2.4, 4),
                                                (16, 3.2, 13), (16, 0.0, 16)])
def test_threads_are_the_cores_other_processes_leave(cores, load, threads):
    assert cli.torch_threads(cores, load) == threads


@pytest.mark.e2e
@pytest.mark.parametrize("command", COMPUTING)
def test_a_computing_command_takes_the_idle_cores_where_omp_num_threads_is_unset(command):
    assert threads_of(command, load=1.2) == "1 1"  # of 2 cores, 1.2 busy: torch alone takes 2


@pytest.mark.e2e
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="torch takes no more threads than cores")
def test_omp_num_threads_set_by_the_user_is_kept():
    assert threads_of("eval", load=0.0) == "2 2"
    assert threads_of("eval", load=0.0, OMP_NUM_THREADS="1") == "1 1"


@pytest.mark.e2e
def test_train_keeps_torchs_threads_whatever_the_load():
    """A run's numbers depend on the threads: the load must not choose them."""
    assert threads_of("train", load=1.2).endswith(" None")  # torch chooses, as without megalite


@pytest.mark.e2e
def test_torchrun_leaves_its_workers_threads_to_torchrun():
    assert threads_of("torchrun", load=1.2).endswith(" None")  # it sets 1 per rank itself
