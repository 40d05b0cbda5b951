"""docs/config.md, the configuration reference, generated from the typed configs so it cannot
drift: every key of every section with its type, default and the comment it has in the source.

    python -m docs.config_docs --out docs/config.md      # regenerate
    python -m docs.config_docs --check docs/config.md    # exit 1 if it is stale

A key's comment is the `#` comment on its line or the block of `#` lines right above it
(tests/test_config_docs.py fails when a key has neither).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

from megalite.launch.sweep import SlurmConfig, SweepFile
from megalite.run_config import Config
from megalite.typed_config import variants

FIELD = re.compile(r"^\s+(\w+): [^#]+?(?:\s+#\s*(.*))?$")


def comments(cls) -> dict[str, str]:
    """Each field of dataclass `cls`: its trailing comment, else the comment block above it."""
    found, block = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        match = FIELD.match(line)
        if match and match.group(1) in {f.name for f in dataclasses.fields(cls)}:
            found[match.group(1)] = match.group(2) or " ".join(block)
        block = []
    return found


def type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Union:
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", None) if typing.get_origin(tp) is None else str(tp).replace("typing.", "")


def default_of(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def sections(cls=Config, prefix: str = "") -> list[tuple[str, type]]:
    """Every section of a run config, a nested one (train.muon) after its parent; a section
    of variants (model.attention) once per variant, named `model.attention (kind: mla)`."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        choices = variants(hints[f.name])
        for kind, variant in choices.items():
            out += [(f"{prefix}{f.name} (kind: {kind})", variant)] + sections(variant, f"{prefix}{f.name}.")
        if dataclasses.is_dataclass(hints[f.name]):
            out += [(prefix + f.name, hints[f.name])] + sections(hints[f.name], f"{prefix}{f.name}.")
    return out


def sweep_sections() -> list[tuple[str, type]]:
    """A sweep file's keys (`megalite slurm`): top level, then its `slurm` mapping."""
    return [("", SweepFile), ("slurm", SlurmConfig)]


def rows(cls) -> list[tuple[str, str, str | None, str]]:
    """(key, type, default (None: required), comment) of every field of a section (a nested
    section has its own table)."""
    hints, notes = typing.get_type_hints(cls), comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        choices = variants(hints[f.name])
        kind = " \\| ".join(f"`{k}`" for k in choices)
        out.append((f.name, f"a section: kind {kind}" if choices else type_name(hints[f.name]),
                    None if f.default is f.default_factory is dataclasses.MISSING else
                    repr(f.default.kind if choices else default_of(f)), notes.get(f.name, "")))
    return out


def table(section: str, cls) -> list[str]:
    section = section.split(" ")[0]
    doc = (cls.__doc__ or "").strip() if section.startswith("model.") else ""
    lines = ([" ".join(doc.split()), ""] if doc and not doc.startswith(cls.__name__ + "(") else []) + [
        "| key | type | default | what |", "|---|---|---|---|"]
    for key, tp, default, note in rows(cls):
        cell = note.replace("|", "\\|")
        shown = "required" if default is None else f"`{default}`"
        lines.append(f"| `{section + '.' if section else ''}{key}` | {tp} | {shown} | {cell} |")
    return lines + [""]


def markdown() -> str:
    lines = ["# Configuration reference", "",
             "Every key of a run config, by section. A YAML config sets them "
             "(`configs/demo.yaml`); any key can be overridden after `--config` as "
             "`section.key=value` (the value parsed as YAML and type-checked; an unknown key is "
             "an error naming the nearest valid one):", "",
             "```bash",
             "torchrun --nproc_per_node 4 -m megalite.train --config configs/demo.yaml "
             "parallel.tp=2 train.max_steps=100",
             "```", "",
             "`model` may also be a preset name (`model=gpt2-small`, from `megalite/presets/`), or a "
             "mapping whose `preset` key names the preset its other keys override. A section of "
             "variants (`model.attention`, `model.positions`, `model.positions.scaling`, "
             "`model.mlp`) has a `kind` choosing one, and only the keys of the kind chosen: "
             "another's is refused, naming the kind that has it. Overriding a section's kind "
             "(`model.mlp.kind=moe`) keeps the keys the new kind shares with the preset's "
             "(its activation) and starts the others from their defaults.", "",
             "Generated from the typed configs (`megalite/config.py`, `megalite/run_config.py`) by "
             "`python -m docs.config_docs --out docs/config.md`; "
             "`tests/test_config_docs.py` fails when this page is stale or a key has no comment.", ""]
    for name, cls in sections():
        lines += [f"## {name}", ""] + table(name, cls) + (init_from_note() if name == "model" else [])
    lines += earlier_keys() + architectures()
    lines += ["# Sweep files", "",
              "`megalite slurm SWEEP.yaml` (see [clusters](clusters.md) and "
              "`configs/sweeps/demo-lr.yaml`) reads these keys (`megalite/launch/sweep.py`).", ""]
    for name, cls in sweep_sections():
        lines += [f"## {name or 'top level'}", ""] + table(name, cls)
    return "\n".join(lines)


def earlier_keys() -> list[str]:
    """The flat model keys of before the sections (flat_keys.MOVED) and their places."""
    from megalite.flat_keys import MOVED
    return ["# Keys of earlier versions", "",
            "Before the model config had sections (b4372df and earlier) its keys were flat. A "
            "checkpoint holding them resumes, exports and initialises runs as the sections they "
            "mean; a config or an override giving them is translated once, with a note naming "
            "each new key (`megalite/flat_keys.py`). A value that picks a variant picks it "
            "(`model.n_experts=8` is `model.mlp.kind=moe` with `model.mlp.experts=8`; 0 is "
            "`model.mlp.kind=dense`).", "", "| earlier key | now |", "|---|---|"] + [
        f"| `model.{old}` | `model.{new}` |" for old, new in MOVED.items()] + [""]


def init_from_note() -> list[str]:
    """Which model keys a run under train.init_from may set (run_setup.with_pretrained)."""
    from megalite.config import TRAINING_SETTINGS
    keys = ", ".join(f"`model.{k}`" for k in TRAINING_SETTINGS)
    return [f"Under `train.init_from` the checkpoint fixes the architecture: every model key but "
            f"the training settings {keys} is the checkpoint's. A training setting the config "
            f"gives is this run's (else the checkpoint's); an architecture key the config gives "
            f"(a preset's included) must equal the checkpoint's, or the run is refused naming "
            f"the key and both values. `model.vocab_size` is the tokenizer's, or the checkpoint's.",
            ""]


def architectures() -> list[str]:
    """Per Hugging Face architecture (hf/convert.ARCHITECTURES): the model settings its recipe
    fixes and those it carries, from the recipe itself; the presets it holds."""
    from megalite.config import PRESET_DIR
    from megalite.run_config import load_model_config
    from megalite.hf.convert import ARCHITECTURES, exportable_as
    from megalite.hf.expressible import SHARED
    presets = {}
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        presets.setdefault(exportable_as(load_model_config(path.stem))[0], []).append(path.stem)
    lines = ["# Architectures", "",
             "What `megalite import --from-hf` reads and `megalite export --to-hf` writes, one "
             "recipe each (`megalite/hf/<name>.py`, registered in `hf/convert.ARCHITECTURES`; "
             "[adding one](architectures.md)). Import sets the `model.` keys from config.json. "
             "An export takes `model.architecture`, or the first architecture that holds the "
             "config: one that fixes each setting below, carries the others listed at any value, "
             "and finds every remaining key at its default (the sizes, "
             + ", ".join(sorted(k for k in SHARED if k != "architecture")) + ", go everywhere).",
             "", "| architecture | fixes | carries | presets |", "|---|---|---|---|"]
    for name, arch in ARCHITECTURES.items():
        fixed = ", ".join(f"{key}={value!r}" for key, value in arch.NEEDS.items())
        lines.append(f"| {name} | {fixed} | {', '.join(sorted(arch.FREE))} | "
                     f"{', '.join(presets.get(name, [])) or '-'} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docs.config_docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", help="write the page here")
    group.add_argument("--check", help="exit 1 if this file is not what would be written")
    args = parser.parse_args(argv)
    text = markdown()
    if args.out:
        Path(args.out).write_text(text)
        return 0
    if Path(args.check).read_text() != text:
        print(f"{args.check} is stale: run python -m docs.config_docs --out {args.check}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
