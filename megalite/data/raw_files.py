"""Which raw files a data path names: the supported kinds, directories and globs expanded in a
stable order (a run keys its cache by them; prepare-data reads them: megalite/prep/)."""
import glob
import sys
from pathlib import Path

from megalite.typed_config import ConfigError

EMBEDDED = Path(__file__).resolve().parent / "corpus" / "python-docs.jsonl.xz"
SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.xz", ".parquet", ".txt")
SUPPORTED = ", ".join(SUFFIXES)


def kind_of(path: Path) -> str | None:
    return next((s for s in SUFFIXES if path.name.lower().endswith(s)), None)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, directories (every supported file under them) and globs, in a stable order, each
    file once however it is spelled. A directory's other files are named on stderr."""
    files: list[Path] = []
    for item in inputs:
        matches = sorted(glob.glob(item, recursive=True)) if glob.has_magic(item) else [item]
        if not matches or not Path(matches[0]).exists():
            raise ConfigError(f"input '{item}' does not exist: give {SUPPORTED} files, "
                              f"directories or globs of them")
        for match in map(Path, matches):
            if match.is_dir():
                inside = sorted(p for p in match.rglob("*") if p.is_file())
                found = [p for p in inside if kind_of(p)]
                if not found:
                    raise ConfigError(f"input directory '{match}' holds no {SUPPORTED} files")
                if others := [str(p) for p in inside if not kind_of(p)]:
                    print(f"prepare-data: skipping {len(others)} files of '{match}' that are "
                          f"not {SUPPORTED}: {', '.join(others[:5])}{' ...' * (len(others) > 5)}",
                          file=sys.stderr)
                files += found
            elif kind_of(match):
                files.append(match)
            else:
                raise ConfigError(f"input '{match}' is not a supported file: name it "
                                  f"{' / '.join('*' + s for s in SUFFIXES)}")
    return list({f.resolve(): f for f in files}.values())
