"""Build megalite's embedded default corpus from the Python documentation's reST sources.

The prose of the Python 3.11 documentation (Debian package `python3.11-doc`, PSF licence, which
allows redistribution) becomes one document per section: headings, directives, code blocks
and tables dropped, inline markup reduced to its text. Written as xz-compressed JSON lines,
{"text": ...} per document, so the quick start needs neither apt nor a download.

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb /tmp/pydoc
    python scripts/build_corpus.py /tmp/pydoc/usr/share/doc/python3.11/html/_sources \
        megalite/data/corpus/python-docs.jsonl.xz
"""
from __future__ import annotations

import json
import lzma
import re
import sys
from textwrap import dedent
from pathlib import Path

HEADING_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+<>_:.])\1{2,}\s*$")
ROLE = re.compile(r":[\w:.-]+:`(?:[^`<]*<)?([^`>]+)>?`")
LITERAL = re.compile(r"``([^`]+)``")
LINK = re.compile(r"`([^`<]+?)\s*(?:<[^`>]*>)?`_{1,2}")
EMPHASIS = re.compile(r"\*{1,2}([^*]+)\*{1,2}")
MIN_WORDS = 40


def clean(paragraph: str) -> str:
    text = " ".join(line.strip() for line in paragraph.splitlines())
    for pattern in (ROLE, LITERAL, LINK, EMPHASIS):
        text = pattern.sub(r"\1", text)
    return text.replace("|", "").replace("\\", "").strip()


CODE_DIRECTIVE = re.compile(r"^\s*\.\. (code-block|testcode|testsetup|doctest|productionlist|sourcecode)::")


def introduces_code(block: str) -> bool:
    return block.rstrip().endswith("::") or bool(CODE_DIRECTIVE.match(block))


def is_prose(paragraph: str) -> bool:
    first = paragraph.splitlines()[0].lstrip("*- ")
    if first.startswith(("..", ">>>", "+", "=", "#", "|", ":", "$", "%")):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return letters > 0.85 * len(paragraph) and len(paragraph.split()) >= 5


def documents(source: str):
    """Yield the prose of each section of one reST file."""
    section: list[str] = []
    in_code = False  # inside the indented body that follows a "::" or a code directive
    for block in re.split(r"\n\s*\n", source):
        lines = block.strip("\n").splitlines()
        if not lines:
            continue
        indented = lines[0][:1].isspace()
        if in_code and indented:
            continue
        in_code = introduces_code(block)
        if any(HEADING_UNDERLINE.match(line) for line in lines[:3]):
            yield "\n\n".join(section)
            section = []
            continue
        text = dedent(block.strip("\n"))
        if is_prose(text):
            section.append(clean(text.lstrip("*- ")))
    yield "\n\n".join(section)


def main(sources: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    count = chars = 0
    with lzma.open(out, "wt", encoding="utf-8", preset=9) as f:
        for path in sorted(sources.rglob("*.rst.txt")):
            if path.name in ("license.rst.txt", "changelog.rst.txt"):
                continue
            for doc in documents(path.read_text(encoding="utf-8")):
                if len(doc.split()) >= MIN_WORDS:
                    f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
                    count, chars = count + 1, chars + len(doc)
    print(f"{count} documents, {chars / 1e6:.1f} MB of text -> {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
