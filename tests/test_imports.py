"""megalite's imports run one way: no file imports, directly or through others, a file that
imports it back. Every import counts, a deferred one inside a function too: deferring an
import hides a cycle from Python, not from the reader."""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "megalite"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str] = frozenset()) -> set[str]:
    """What `path` imports (`from a import b` names a.b where that is one of `modules`)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names)
    return found - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    # A package's __init__ runs before any of its modules: an import of megalite.a.b imports
    # megalite.a too, but that edge is the language's, not a choice of the importer's.
    return {module_name(p): imported(p, modules) & modules for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.unit
def test_the_walk_finds_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.unit
def test_the_walk_sees_module_level_and_deferred_imports():
    graph = import_graph()
    assert "megalite.parallel.mappings" in graph["megalite.parallel.layers"]
    assert "megalite.failures" in graph["megalite.cli"]  # inside a function


@pytest.mark.unit
def test_the_package_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def part_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


@pytest.mark.unit
def test_the_package_s_parts_import_one_way():
    """Folders (parallel/, model/, pipeline/, training/, data/, hf/, launch/) and top-level
    modules as single nodes: none imports one that imports it back."""
    parts: dict[str, set[str]] = {}
    for module, names in import_graph().items():
        mine = part_of(module)
        parts.setdefault(mine, set()).update(part_of(n) for n in names if part_of(n) != mine)
    found = cycles(parts)
    assert not found, "cycles between parts:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.unit
def test_the_trainer_never_imports_the_measuring_tools():
    """bench/ runs megalite from outside; nothing in the package reaches back into it."""
    reaching = {module_name(p): sorted(n for n in imported(p) if n.split(".")[0] == "bench")
                for p in sorted(PACKAGE.rglob("*.py"))}
    assert not {m: names for m, names in reaching.items() if names}


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    return seen


@pytest.mark.unit
def test_no_training_rank_imports_the_preparation_room():
    """prep/ is prepare-data's (a rank runs it as a process of its own: data_for_run); the
    training loop, eval, generate and export reach none of it, deferred imports included."""
    graph = import_graph()
    for entry in ("megalite.train", "megalite.evaluate", "megalite.generate", "megalite.hf.convert"):
        assert not {m for m in reached(graph, entry) if m.startswith("megalite.prep")}, entry
    assert "megalite.prep.shards" in reached(graph, "megalite.prep.command")  # the walk sees prep


@pytest.mark.e2e
def test_an_installed_copy_holds_every_file_megalite_reads(tmp_path):
    """`pip install .` (not editable) puts in site-packages the model presets, the sbatch
    template and the embedded corpus: a run from anywhere finds them, not only from a clone."""
    source, site = tmp_path / "source", tmp_path / "site"
    shutil.copytree(PACKAGE, source / "megalite", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):  # built from a copy: no build/ left in the tree
        shutil.copy(PACKAGE.parent / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(source)],
                   check=True, capture_output=True, timeout=600)
    code = """
import megalite, sys
from megalite.config import PRESET_DIR
from megalite.run_config import load_model_config
from megalite.data.raw_files import EMBEDDED
from megalite.launch.slurm import TEMPLATE
assert megalite.__file__.startswith(sys.argv[1]), megalite.__file__
for name in ("tiny", "gpt2-small", "gpt2-medium", "llama-1b"):
    load_model_config(name)
assert TEMPLATE.is_file() and EMBEDDED.is_file(), (TEMPLATE, EMBEDDED)
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    subprocess.run([sys.executable, "-c", code, str(site)], check=True, cwd=tmp_path, env=env,
                   timeout=300)
