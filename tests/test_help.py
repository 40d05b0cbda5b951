"""`megalite <command> --help`, and a command's bad arguments, are answered before torch is
imported (megalite/command_args.py): torch alone took 6-29 s to import on a busy machine."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megalite import cli
from tests.support.launch import REQUIRED

ROOT = Path(__file__).resolve().parent.parent
# `megalite ARGS` as the console script runs it; its last line on stderr says whether torch
# was imported (also when argparse exits).
MEGALITE = """import sys
from megalite.cli import main
try:
    sys.exit(main(sys.argv[1:]))
finally:
    print("torch imported" if "torch" in sys.modules else "torch not imported", file=sys.stderr)
"""
# Each command's options (and positionals) as its --help listed them before the parsers moved.
OPTIONS = {
    "train": ["overrides", "-h", "--config"],
    "export": ["-h", "--ckpt", "--to-hf", "--dtype", "--max-shard-gb"],
    "import": ["-h", "--from-hf", "--to", "--eos-token"],
    "eval": ["-h", "--ckpt", "--text", "--chat", "--chat-template", "--train-on", "--tp", "--pp",
             "--pp-layers", "--cp", "--ep", "--json"],
    "generate": ["-h", "--ckpt", "--prompt", "--chat", "--chat-template", "--tp", "--pp",
                 "--pp-layers", "--ep", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                 "--seed"],
    "slurm": ["sweep", "-h", "--dry-run", "--submit"],
    "sweep-status": ["sweep_dir", "-h", "--json"],
    "prepare-data": None,  # another module's options, parsed there before torch already
}


def megalite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", MEGALITE, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def listed_options(help_text: str) -> list[str]:
    """The first name of each argument in the help's argument sections, in order."""
    sections = re.split(r"^(?:positional arguments|options):$", help_text, flags=re.M)[1:]
    return [name for section in sections for name in re.findall(r"^  ([-\w]+)", section, re.M)]


@pytest.mark.unit
def test_every_command_but_torchrun_is_listed():
    assert sorted(OPTIONS) == sorted(set(cli.COMMANDS) - {"torchrun"})  # torchrun's help is torch's


@pytest.mark.e2e
@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_help_lists_the_options_without_importing_torch(command):
    done = megalite(command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["torch not imported"]
    assert done.stdout.startswith(f"usage: megalite {command} ")
    if OPTIONS[command] is not None:
        assert listed_options(done.stdout) == OPTIONS[command]


@pytest.mark.e2e
@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_a_bad_argument_is_refused_without_importing_torch(command):
    done = megalite(command, *REQUIRED[command], "--no-such-option")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-2:] == [
        f"megalite {command}: error: unrecognized arguments: --no-such-option", "torch not imported"]


@pytest.mark.unit
def test_the_torch_free_choices_are_the_commands_own():
    """command_args restates two lists its torch-free parsers cannot import: they must agree."""
    from megalite import command_args
    from megalite.data.chat import TRAIN_ON
    from megalite.hf.convert import DTYPES
    assert command_args.TRAIN_ON == TRAIN_ON
    export = command_args.export_parser()
    dtype = next(a for a in export._actions if a.dest == "dtype")
    assert tuple(dtype.choices) == tuple(DTYPES)
