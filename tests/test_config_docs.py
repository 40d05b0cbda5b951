"""docs/config.md, the configuration reference, is what docs/config_docs.py generates from the
typed configs now; every key has a comment; its keys are exactly those a config accepts."""
import dataclasses
import typing
from pathlib import Path

import pytest

from docs.config_docs import main, markdown, rows, sections, sweep_sections
from megalite.run_config import load_config
from megalite.typed_config import ConfigError, variants

pytestmark = pytest.mark.unit

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def test_every_key_of_every_section_has_a_comment():
    missing = [f"{name}.{key}" for name, cls in sections() + sweep_sections()
               for key, _, _, note in rows(cls) if not note]
    assert not missing, f"add a comment to these config fields (docs/config.md shows it): {missing}"


def test_the_committed_page_is_current(capsys):
    assert PAGE.read_text() == markdown(), "run: python -m docs.config_docs --out docs/config.md"
    assert main(["--check", str(PAGE)]) == 0


def test_a_stale_page_is_reported(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(markdown().replace("parallel.cp_comm", "parallel.cp_mode"))
    assert main(["--check", str(stale)]) == 1
    assert "python -m docs.config_docs --out" in capsys.readouterr().err


def test_the_documented_keys_are_the_keys_a_config_accepts():
    run_config = markdown().split("# Keys of earlier versions")[0]
    documented = [line.split("`")[1] for line in run_config.splitlines() if line.startswith("| `")]
    # Each field of each section (a variant's with its kind chosen, and its parents') is
    # accepted as an override with its documented default.
    kinds, every = {}, set()
    for name, cls in sections():
        section, _, kind = name.partition(" (kind: ")
        if kind:
            kinds = {k: v for k, v in kinds.items() if not k.startswith(section)}
            kinds[section] = kind.rstrip(")")
        chosen = [f"{k}.kind={v}" for k, v in kinds.items() if section.startswith(k)]
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            value = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if variants(typing.get_type_hints(cls)[f.name]):  # a section of variants: its row is its kind
                load_config(None, chosen + [f"{key}.kind={value.kind}"])
            elif not dataclasses.is_dataclass(value):
                load_config(None, chosen + [f"{key}={_yaml(value)}"])
            else:
                continue
            every.add(key)
    assert set(documented) == every
    with pytest.raises(ConfigError, match="parallel.cp_comm"):
        load_config(None, ["parallel.cp_comms=p2p"])  # an unknown key names the nearest valid one


def _yaml(value) -> str:
    import yaml
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def test_a_literal_key_lists_its_choices():
    line = next(line for line in markdown().splitlines() if line.startswith("| `parallel.cp_comm` |"))
    assert "`all_gather` \\| `p2p`" in line and "`'all_gather'`" in line


def test_the_documented_sweep_keys_are_the_keys_a_sweep_file_accepts():
    from megalite.launch.sweep import SweepFile
    from megalite.typed_config import from_dict
    sweep = markdown().split("# Sweep files")[1]
    documented = [line.split("`")[1] for line in sweep.splitlines() if line.startswith("| `")]
    defaults = from_dict(SweepFile, {"name": "x", "base": "x"})
    for key in documented:  # each one accepted in a sweep file, with its documented default
        section, _, name = key.rpartition(".")
        value = getattr(defaults.slurm if section else defaults, name)
        tree = {"slurm": {name: value}} if section else {name: value}
        from_dict(SweepFile, {"name": "x", "base": "x", **tree}, "sweep.")
    every = {f.name for f in dataclasses.fields(SweepFile) if f.name != "slurm"}
    assert set(documented) == every | {f"slurm.{f.name}" for f in dataclasses.fields(defaults.slurm)}
    with pytest.raises(ConfigError, match="cpus_per_task"):
        from_dict(SweepFile, {"name": "x", "base": "x", "slurm": {"cpus_per_tsk": 4}}, "sweep.")
