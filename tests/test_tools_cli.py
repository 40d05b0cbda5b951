"""The commands of megalite and of the measuring tools (`python -m bench`, bench/__main__.py):
each listed in --help with what it does, each option's default shown in its --help, and a
megalite command that moved to the tools saying where.
"""
import argparse
import re

import pytest

from bench.__main__ import COMMANDS as BENCH_COMMANDS
from megalite import cli, command_args

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("prog,table", [("megalite", cli.COMMANDS), ("python -m bench", BENCH_COMMANDS)])
def test_help_lists_every_command_with_what_it_does(capsys, prog, table):
    assert cli.dispatch(prog, table, ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} <command>")
    for name in table:
        assert re.search(rf"^  {re.escape(name)} +\w", out, flags=re.M), name


@pytest.mark.parametrize("old", sorted(cli.MOVED))
def test_a_command_that_moved_to_the_measuring_tools_says_where(capsys, old):
    assert cli.main([old]) == 2
    new = cli.MOVED[old]
    assert new in BENCH_COMMANDS
    assert f"run `python -m bench {new}`" in capsys.readouterr().err


@pytest.mark.parametrize("table,command", [(cli.COMMANDS, c) for c in cli.COMMANDS if c != "torchrun"]
                         + [(BENCH_COMMANDS, c) for c in BENCH_COMMANDS])  # torchrun's help is its own
def test_every_option_with_a_default_shows_it_in_help(monkeypatch, capsys, table, command):
    parsers = []
    parse = argparse.ArgumentParser.parse_args

    def keep(parser, *args, **kwargs):
        parsers.append(parser)
        return parse(parser, *args, **kwargs)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    with pytest.raises(SystemExit) as stop:
        cli.dispatch("prog", table, [command, "--help"])
    assert stop.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    parser = parsers[0]
    assert parser.formatter_class is command_args.HelpFormatter
    defaulted = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
                 and a.default not in (None, False, [], argparse.SUPPRESS)]
    formatter = parser._get_formatter()
    for action in defaulted:  # its own help, as --help prints it, names its default
        help_text = " ".join(formatter._expand_help(action).split())
        assert str(action.default) in help_text and help_text in shown, action.dest
    if command == "generate":
        assert "0: greedy" in shown
