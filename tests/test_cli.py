"""The command line a new user meets: `megalite --help` and `--version`, every command's
defaults in its --help, and a wrong --ckpt answered with the path or command to use."""
import argparse
import importlib.metadata
import re

import pytest

from megalite import cli


def test_help_lists_every_command_with_what_it_does(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert re.search(rf"^  {re.escape(name)} +\w", out, flags=re.M), name


@pytest.mark.parametrize("argv", [[], ["trian"]])
def test_misuse_lists_the_commands_and_exits_2(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert all(f"  {name} " in err for name in cli.COMMANDS)
    if argv:
        assert "unknown command 'trian' (did you mean 'train'?)" in err


def test_version_is_the_installed_packages(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"megalite {importlib.metadata.version('megalite')}\n"


@pytest.mark.parametrize("command", [c for c in cli.COMMANDS if c != "torchrun"])  # torchrun's own
def test_every_option_with_a_default_shows_it_in_help(monkeypatch, capsys, command):
    parsers = []
    parse = argparse.ArgumentParser.parse_args

    def keep(parser, *args, **kwargs):
        parsers.append(parser)
        return parse(parser, *args, **kwargs)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    assert stop.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    parser = parsers[0]
    assert parser.formatter_class is cli.HelpFormatter
    formatter = parser._get_formatter()
    defaulted = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
                 and a.default not in (None, False, [], argparse.SUPPRESS)]
    for action in defaulted:
        assert action.help and "%(default)" in formatter._get_help_string(action), action.dest
        assert str(action.default) in shown, action.dest
    if command == "generate":
        assert "0: greedy" in shown


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


@pytest.mark.parametrize("command", sorted(COMMANDS_WITH_CKPT))
def test_a_run_directory_given_as_ckpt_suggests_its_newest_checkpoint(tmp_path, capsys, command):
    newest = fake_run_dir(tmp_path / "run")
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        assert cli.main([command, "--ckpt", str(given), *COMMANDS_WITH_CKPT[command]]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"megalite: error: '{given}' is a ") and err.count("\n") == 1, err
        assert f"give its newest checkpoint, '{newest}'" in err


@pytest.mark.parametrize("command", sorted(COMMANDS_WITH_CKPT))
def test_a_hugging_face_directory_given_as_ckpt_suggests_import(tmp_path, capsys, command):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert cli.main([command, "--ckpt", str(hf), *COMMANDS_WITH_CKPT[command]]) == 2
    assert f"make one of it first with `megalite import --from-hf {hf} --to CKPT`" in \
        capsys.readouterr().err
