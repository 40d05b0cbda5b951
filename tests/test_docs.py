"""The training commands README and docs/ show are valid: each `torchrun ... -m megalite.train
--config C key=value ...` (and `megalite train`) passes every check that runs before a process
group exists, at the world size its launcher flags give (nproc_per_node x nnodes)."""
import re
import shlex
from pathlib import Path

import pytest

from megalite.run_config import load_config
from megalite.plan import validate

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def train_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every training command in the pages' bash blocks, continuations joined."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line.split(" # ")[0], comments=True)
                if "megalite.train" in words or words[:2] == ["megalite", "train"]:
                    found.append((page.name, words))
    return found


def world_of(words: list[str]) -> int:
    flags = dict(re.findall(r"--(nproc_per_node|nnodes)[ =](\d+)", " ".join(words)))
    return int(flags.get("nproc_per_node", 1)) * int(flags.get("nnodes", 1))


COMMANDS = train_commands()


def test_the_pages_show_training_commands():
    assert len(COMMANDS) >= 10 and {page for page, _ in COMMANDS} >= {"README.md", "parallelism.md"}


@pytest.mark.parametrize("page, words", COMMANDS, ids=[f"{p}:{' '.join(w)[:70]}" for p, w in COMMANDS])
def test_a_shown_training_command_is_valid(page, words):
    argv = words[words.index("--config") + 1:]
    config, overrides = argv[0], [w for w in argv[1:] if "=" in w]
    validate(load_config(ROOT / config, overrides), world_of(words), installed=False)


def slug(heading: str) -> str:
    """Python-Markdown's toc id of a heading (the anchors mkdocs makes)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def test_readme_links_reach_pages_and_their_sections():
    links = re.findall(r"\]\(([^)#]+\.md)(?:#([^)]+))?\)", (ROOT / "README.md").read_text())
    # Every topic page one click away (index.md is the site's front page, as README is here).
    assert {target for target, _ in links} >= {f"docs/{p.name}" for p in PAGES[1:] if p.name != "index.md"}
    for target, anchor in links:
        page = ROOT / target
        assert page.is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
            assert anchor in {slug(h) for h in headings}, f"{target}#{anchor}"


def test_the_site_shows_readmes_quick_start():
    def quick_start(text: str) -> str:
        return text.split("## Quick start", 1)[1].split("\n## ", 1)[0].strip()
    assert quick_start((ROOT / "docs" / "getting-started.md").read_text()) == quick_start(
        (ROOT / "README.md").read_text())


def test_the_design_page_names_every_module():
    """docs/design.md's layout of the code lists each of the package's modules by file name,
    under its folder's heading (a module added without a line there fails)."""
    tree = (ROOT / "docs" / "design.md").read_text().split("## Layout of the code")[1]
    lines = tree.split("```")[1].split("megalite/\n")[1].splitlines()
    package = lines[:next(i for i, line in enumerate(lines) if not line.startswith(" "))]
    folder, listed = "", set()
    for line in package:
        depth = len(line) - len(line.lstrip())
        head = re.match(r"\s*([\w/]+/)\s*$|\s*((?:\w+\.py(?:, )?)+)", line)
        if depth == 2:
            folder = head.group(1) if head and head.group(1) else ""
        if head and head.group(2):
            listed |= {folder + name for name in head.group(2).split(", ")}
    modules = {str(p.relative_to(ROOT / "megalite")) for p in (ROOT / "megalite").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert modules - listed == set(), "not in docs/design.md"
    assert listed - modules == set(), "in docs/design.md, not in megalite/"
