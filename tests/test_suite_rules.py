"""Rules the suite keeps about itself, read off its own source and collection.

1. Every test that can train with train.engine=deepspeed carries the `deepspeed` mark, which
   tests/conftest.py turns into a skip where the package is missing (README's quick start does
   not install it; .ci/run does, so CI alone would never see a test that is not marked).
2. Every wait on another process has a bound: subprocess calls and Popen waits take a timeout,
   FileLocks too (a rank's own bound is tests/support/harness.py's, tested in test_harness.py).
3. Every test is in exactly one tier (pyproject.toml's markers): `unit`, `exactness` or `e2e`,
   and a unit test that starts a process fails, saying so (tests/conftest.py).

Which tests can train with DeepSpeed is found from the source (ast), not by running them: a
test does when what it reaches (its body, its fixtures, the functions and module-level values
they name, in its module and the tests.* modules it imports from) both names the engine
(`train.engine=deepspeed` in an argv, `engine="deepspeed"` in a config) and trains (megalite's
trainer, in this process or under torchrun, or an engine built directly). A test that names the
engine without training only checks a refusal (test_muon.py, test_pure_bf16.py, ...) and needs
no package. Where the engine is named inside a module-level table (test_fp8_train.py's
LAYOUTS), only the cases whose parameters pick that entry's key train with it.
"""
from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENGINE = re.compile(r"""engine\s*=\s*['"]?deepspeed\b|['"]engine['"]\s*:\s*['"]deepspeed['"]""")
# What trains: megalite's trainer (called, or `-m megalite.train` under torchrun or in a
# subprocess) and the engine builders.
TRAINERS = {"megalite.train.main", "megalite.training.build.build_engine",
            "megalite.training.deepspeed_engine.DeepSpeedEngine"}
TRAINER_ARGV = ("-m", "megalite.train")


@dataclass
class Module:
    name: str
    defs: dict[str, ast.AST]  # top-level functions, classes and assigned names
    origins: dict[str, str]  # an imported name -> "package.module" or "package.module.name"


@cache
def module(name: str, root: Path = TESTS) -> Module | None:
    path = root / f"{name.removeprefix('tests.').replace('.', '/')}.py"  # tests.support.runs too
    if not name.startswith("tests.") or not path.is_file():
        return None
    tree = ast.parse(path.read_text(), str(path))
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        defs[n.id] = node
    return Module(name, defs, imports(tree))


def imports(tree: ast.AST) -> dict[str, str]:
    """Each imported name -> what it is; local imports too (`from tests.x import y` in a test)."""
    origins: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                origins[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                origins[a.asname or a.name] = f"{node.module}.{a.name}"
    return origins


def dotted(node: ast.AST, origins: dict[str, str]) -> str | None:
    """`train_module.main` as the thing it is, "megalite.train.main"."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in origins:
        return ".".join([origins[node.id], *reversed(attrs)])
    return None


@dataclass
class Reach:
    trains: bool = False
    in_code: bool = False  # the engine named in a function's body: every case trains with it
    decorated: bool = False  # named in a parametrize/fixture decorator: the cases holding it
    # (or holding "deepspeed" itself, which the test may put into an argv: f"train.engine={e}")
    table_keys: set[str] = field(default_factory=set)  # named in a table: the cases picking a key
    whole_table: bool = False  # named in module-level data, under no key
    strings: set[str] = field(default_factory=set)  # string constants of the code reached


def names_engine(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return bool(ENGINE.search(node.value))
    if isinstance(node, ast.keyword):
        return (node.arg == "engine" and isinstance(node.value, ast.Constant)
                and node.value.value == "deepspeed")
    if isinstance(node, ast.Dict):
        return any(isinstance(k, ast.Constant) and k.value == "engine" and isinstance(v, ast.Constant)
                   and v.value == "deepspeed" for k, v in zip(node.keys, node.values))
    return False


def table_hits(node: ast.AST, keys: tuple[str, ...], reach: Reach) -> None:
    """Where module-level data names the engine: under which dict keys."""
    if names_engine(node):
        reach.table_keys.update(keys)
        reach.whole_table |= not keys
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values):
            key = (k.value,) if isinstance(k, ast.Constant) and isinstance(k.value, str) else ()
            table_hits(v, keys + key, reach)
        return
    for child in ast.iter_child_nodes(node):
        table_hits(child, keys, reach)


def reach(module_name: str, test: str, root: Path = TESTS) -> Reach:
    """What the test `test` of tests.`module_name` reaches (see the module's docstring)."""
    found = Reach()
    conftest = module("tests.conftest", root)
    todo, seen = [(module(module_name, root), test)], set()
    while todo:
        mod, name = todo.pop()
        if mod is None or (mod.name, name) in seen:
            continue
        seen.add((mod.name, name))
        node = mod.defs.get(name)
        if node is None:
            origin = mod.origins.get(name, "")
            found.trains |= origin in TRAINERS
            if origin.startswith("tests."):
                todo.append((module(origin.rpartition(".")[0], root), origin.rpartition(".")[2]))
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            table_hits(node, (), found)
        else:
            decorators = [n for d in getattr(node, "decorator_list", []) for n in ast.walk(d)]
            found.decorated |= any(names_engine(n) or (isinstance(n, ast.Constant) and n.value == "deepspeed")
                                   for n in decorators)
            body = [n for stmt in getattr(node, "body", []) for n in ast.walk(stmt)]
            found.in_code |= any(names_engine(n) for n in body)
            for n in body:
                if isinstance(n, ast.Constant) and isinstance(n.value, str):
                    found.strings.add(n.value)
                found.trains |= launches_the_trainer(n)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:  # fixtures
                    todo += [(mod, arg.arg), (conftest, arg.arg)]
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                todo.append((mod, n.id))
            elif isinstance(n, ast.Attribute):
                found.trains |= dotted(n, mod.origins) in TRAINERS
    return found


def launches_the_trainer(node: ast.AST) -> bool:
    """`-m megalite.train` in a command's list, tuple or call arguments (not any mention of the
    module: the harness names it among the modules its ranks preload)."""
    items = (node.elts if isinstance(node, (ast.List, ast.Tuple))
             else node.args if isinstance(node, ast.Call) else [])
    values = [i.value if isinstance(i, ast.Constant) else None for i in items]
    return any(tuple(values[i:i + 2]) == TRAINER_ARGV for i in range(len(values) - 1))


def trains_with_deepspeed(r: Reach, params_text: str, params_strings: set[str]) -> bool:
    """Whether a case (its parameters' repr, and the strings among them) trains with DeepSpeed."""
    if not r.trains:
        return False
    picked = r.table_keys & (params_strings | r.strings)
    held = bool(ENGINE.search(params_text)) or "deepspeed" in params_strings
    return r.in_code or r.whole_table or bool(picked) or (r.decorated and held)


def candidates(root: Path = TESTS) -> dict[str, set[str]]:
    """Module name -> its test functions that can train with DeepSpeed in some case."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.glob("test_*.py")):
        mod = module(f"tests.{path.stem}", root)
        for name, node in mod.defs.items():
            if name.startswith("test") and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                r = reach(mod.name, name, root)
                if r.trains and (r.in_code or r.decorated or r.table_keys or r.whole_table):
                    out.setdefault(path.stem, set()).add(name)
    return out


# Collects the given test files with pytest itself (its parameters, ids and marks), the deepspeed
# package hidden as it is where it was never installed (importlib finds no spec for it) unless
# told to keep it, and writes each item's facts as JSON.
PROBE = r"""
import json, sys
if sys.argv[2] == "hide-deepspeed":
    sys.modules["deepspeed"] = None
import pytest

TIERS = ("unit", "exactness", "e2e")

def strings(value, out):
    if isinstance(value, str):
        out.add(value)
    elif isinstance(value, (tuple, list, set, frozenset)):
        for v in value:
            strings(v, out)
    elif isinstance(value, dict):
        for k, v in value.items():
            strings(k, out), strings(v, out)
    return out

class Probe:
    def pytest_collection_finish(self, session):
        rows = []
        for item in session.items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            rows.append({"nodeid": item.nodeid, "module": item.module.__name__.rpartition(".")[2],
                         "function": item.originalname, "params": repr(params),
                         "strings": sorted(strings(list(params.values()), set())),
                         "marked": item.get_closest_marker("deepspeed") is not None,
                         "skipped": any(m.name == "skip" for m in item.iter_markers()),
                         "tiers": sorted({m.name for m in item.iter_markers() if m.name in TIERS})})
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f)

# In this one process (no pyproject addopts, so no xdist workers, and xdist not needed).
sys.exit(pytest.main(["--collect-only", "-q", "-o", "addopts=", "-p", "no:xdist",
                      "-p", "no:cacheprovider", *sys.argv[3:]], plugins=[Probe()]))
"""


def collected(tmp_path, modules: list[str], hide_deepspeed: bool = True) -> list[dict]:
    out = tmp_path / "items.json"
    done = subprocess.run([sys.executable, "-c", PROBE, str(out),
                           "hide-deepspeed" if hide_deepspeed else "keep-deepspeed"]
                          + [f"tests/{m}.py" for m in modules],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.e2e
def test_every_test_that_trains_with_deepspeed_is_marked_and_skips_without_it(tmp_path):
    found = candidates()
    items = collected(tmp_path, sorted(found))
    cases = [i for i in items if i["function"] in found.get(i["module"], ())
             and trains_with_deepspeed(reach(f"tests.{i['module']}", i["function"]), i["params"],
                                       set(i["strings"]))]
    hidden = {f"{m}::{f}" for m, fs in found.items() for f in fs} - {
        f"{i['module']}::{i['function']}" for i in items}
    assert not hidden, ("not collected with deepspeed missing (a module-level importorskip? mark "
                        f"them deepspeed instead): {sorted(hidden)}")
    unmarked = [i["nodeid"] for i in cases if not i["marked"]]
    assert not unmarked, f"train with train.engine=deepspeed but not marked deepspeed: {unmarked}"
    assert all(i["skipped"] for i in cases), "marked but not skipped without the package"
    # The search finds what it must (so the checks above are not vacuous), and not fp8's
    # layouts that train natively.
    ids = {i["nodeid"] for i in cases}
    assert {"tests/test_deepspeed.py::test_zero_trains_like_the_native_engine[0]",
            "tests/test_fp8_train.py::test_fp8_trains_like_one_process[dp2-deepspeed-zero2]",
            "tests/test_sequence_parallel.py::test_deepspeed_zero2_with_sequence_parallel_trains_like_native",
            } <= ids, sorted(ids)
    assert "tests/test_fp8_train.py::test_fp8_trains_like_one_process[tp2-dp2-rowwise]" not in ids


SAMPLE = {"conftest.py": """
import pytest
from megalite.run_config import TrainConfig
from megalite.training.build import build_engine

@pytest.fixture
def zero_engine():
    return build_engine(None, TrainConfig(engine="deepspeed"), None)
""", "test_sample.py": """
import subprocess
import pytest
from megalite import train as train_module
from megalite.config import load_config

TABLE = {"plain": ["parallel.tp=2"], "zero2": ["train.engine=deepspeed", "train.zero_stage=2"]}

def run(argv):
    return train_module.main(argv)

def test_refusal():
    load_config(None, ["train.engine=deepspeed"])

def test_direct():
    run(["train.engine=deepspeed"])

@pytest.mark.parametrize("name", list(TABLE))
def test_table(name):
    run(TABLE[name])

@pytest.mark.parametrize("engine", ["native", "deepspeed"])
def test_engine_as_parameter(engine):
    run([f"train.engine={engine}"])

def test_fixture(zero_engine):
    pass

def test_under_torchrun():
    subprocess.run(["torchrun", "-m", "megalite.train", "train.engine=deepspeed"], timeout=60)

def test_module_only_named():
    load_config(None, ["train.engine=deepspeed"], preload=["megalite.train"])
"""}


@pytest.mark.unit
def test_the_search_tells_each_way_of_training_with_deepspeed_from_a_refusal(tmp_path):
    """The search on a sample of each shape: the engine in the test's argv, in a table entry
    its parameter picks, as a parameter, in a fixture, under torchrun; and named only to be
    refused."""
    for name, text in SAMPLE.items():
        (tmp_path / name).write_text(text)
    assert candidates(tmp_path) == {"test_sample": {"test_direct", "test_table", "test_engine_as_parameter",
                                                    "test_fixture", "test_under_torchrun"}}
    case = lambda test, *params: trains_with_deepspeed(  # noqa: E731
        reach("tests.test_sample", test, tmp_path), repr(params), set(params))
    assert case("test_direct") and case("test_fixture")
    assert case("test_table", "zero2") and not case("test_table", "plain")
    assert case("test_engine_as_parameter", "deepspeed") and not case("test_engine_as_parameter", "native")
    assert case("test_under_torchrun")
    assert not case("test_refusal") and not case("test_module_only_named")


@pytest.mark.unit
def test_the_mark_skips_only_where_deepspeed_is_missing(monkeypatch):
    import tests.conftest as conftest

    class Item:
        def __init__(self, marked):
            self.marks = [pytest.mark.deepspeed.mark] if marked else []

        def get_closest_marker(self, name):
            return next((m for m in self.marks if m.name == name), None)

        def add_marker(self, mark):
            self.marks.append(mark.mark)

    def skipped(present: bool) -> list[bool]:
        if present:  # a spec to find, as an installed package has
            module = type(sys)("deepspeed")
            module.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
            monkeypatch.setitem(sys.modules, "deepspeed", module)
        else:
            monkeypatch.setitem(sys.modules, "deepspeed", None)
        items = [Item(True), Item(False)]
        conftest.pytest_collection_modifyitems(None, items)
        return [any(m.name == "skip" for m in i.marks) for i in items]
    assert skipped(present=False) == [True, False]
    assert skipped(present=True) == [False, False]


TIERS = ("unit", "exactness", "e2e")


@pytest.mark.e2e
def test_every_test_is_in_exactly_one_tier(tmp_path):
    """So `-m unit`, `-m exactness` and `-m e2e` together run the suite, each test once."""
    items = collected(tmp_path, [p.stem for p in sorted(TESTS.glob("test_*.py"))], hide_deepspeed=False)
    assert len(items) > 900, len(items)  # the whole suite
    wrong = [f"{i['nodeid']}: {' and '.join(i['tiers']) or 'none'}" for i in items if len(i["tiers"]) != 1]
    assert not wrong, (f"each test needs exactly one of the marks {', '.join(TIERS)} (pyproject.toml "
                       f"says what each holds):\n" + "\n".join(wrong))


# Unit tests that each start a process one way, and a test that may: run with tests/conftest.py.
TIER_SAMPLE = """
import multiprocessing, subprocess, sys
import pytest
import torch.distributed as dist
import torch.multiprocessing

@pytest.mark.unit  # the tier under test
def test_popen():
    subprocess.run([sys.executable, "-c", "pass"], timeout=60)

@pytest.mark.unit  # the tier under test
def test_multiprocessing():
    multiprocessing.get_context("spawn").Process(target=print).start()

@pytest.mark.unit  # the tier under test
def test_torch_multiprocessing():
    torch.multiprocessing.get_context("spawn").Process(target=print).start()

@pytest.mark.unit  # the tier under test
def test_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)

@pytest.mark.unit  # the tier under test
def test_caught():
    try:
        subprocess.check_output(["true"], timeout=60)
    except Exception:
        pass

@pytest.fixture
def started():
    return subprocess.run(["true"], timeout=60).returncode

@pytest.mark.unit  # the tier under test
def test_in_a_fixture(started):
    pass

@pytest.mark.unit  # the tier under test
def test_in_process():
    assert sum(range(4)) == 6

@pytest.mark.e2e  # the tier under test
def test_e2e_may():
    assert subprocess.run(["true"], timeout=60).returncode == 0
"""


@pytest.mark.e2e
def test_a_unit_test_that_starts_a_process_fails_naming_itself(tmp_path):
    (tmp_path / "test_tiers_sample.py").write_text(TIER_SAMPLE)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-o", "addopts=",
                           "-p", "no:cacheprovider", "-p", "no:xdist", "-rA", "-q",
                           str(tmp_path / "test_tiers_sample.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    outcome = {name: result for result, name in re.findall(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", out,
                                                             flags=re.M)}
    assert outcome == {"test_popen": "FAILED", "test_multiprocessing": "FAILED",
                       "test_torch_multiprocessing": "FAILED", "test_process_group": "FAILED",
                       "test_caught": "FAILED", "test_in_a_fixture": "ERROR", "test_in_process": "PASSED",
                       "test_e2e_may": "PASSED"}, out[-4000:]
    for name, what in [("test_popen", "started a subprocess"), ("test_multiprocessing", "started a process"),
                       ("test_process_group", "started a process group")]:
        assert re.search(rf"test_tiers_sample\.py::{name} {what} .*: a unit test starts no process: "
                         rf"mark it exactness or e2e", out), (name, out[-4000:])


# A call of one of these without timeout= waits as long as the child runs.
SUBPROCESS_WAITS = {"subprocess.run", "subprocess.call", "subprocess.check_call",
                    "subprocess.check_output"}


def unbounded_waits(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    origins = imports(tree)
    # Names bound to a Popen: assigned one, `with ... as` one, one from a function of this file
    # that returns one, or a parameter annotated as one.
    is_popen = lambda node: node is not None and dotted(node, origins) == "subprocess.Popen"  # noqa: E731
    makers = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and is_popen(n.returns)}
    popens = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg) and is_popen(a.annotation)}
    for n in ast.walk(tree):
        value, targets = None, []
        if isinstance(n, ast.Assign):
            value, targets = n.value, n.targets
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            value, targets = n.context_expr, [n.optional_vars]
        if isinstance(value, ast.Call) and (dotted(value.func, origins) == "subprocess.Popen" or (
                isinstance(value.func, ast.Name) and value.func.id in makers)):
            popens |= {t.id for t in targets if isinstance(t, ast.Name)}
    found = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call) or any(k.arg == "timeout" for k in n.keywords):
            continue
        what = dotted(n.func, origins)
        waits_on_popen = (isinstance(n.func, ast.Attribute) and n.func.attr in ("wait", "communicate")
                          and isinstance(n.func.value, ast.Name) and n.func.value.id in popens
                          and not n.args)
        if what in SUBPROCESS_WAITS or waits_on_popen or what == "filelock.FileLock":
            found.append(f"{path.name}:{n.lineno}: {ast.unparse(n)[:80]}")
    return found


@pytest.mark.unit
def test_every_wait_on_another_process_has_a_timeout():
    found = [w for path in sorted([*TESTS.glob("*.py"), *(TESTS / "support").glob("*.py")])
             for w in unbounded_waits(path)]
    assert not found, "waits without a timeout:\n" + "\n".join(found)


@pytest.mark.unit
def test_the_wait_rule_sees_each_kind_of_unbounded_wait(tmp_path):
    """The rule above can fail: each kind of wait it looks for, written without a bound."""
    source = tmp_path / "test_waits.py"
    source.write_text("import subprocess\nfrom filelock import FileLock\n\n"
                      "def start() -> subprocess.Popen:\n    return subprocess.Popen(['true'])\n\n"
                      "def test_it():\n    subprocess.run(['true'])\n    p = subprocess.Popen(['true'])\n"
                      "    p.wait()\n    start().wait(timeout=5)\n    q = start()\n    q.communicate()\n"
                      "    FileLock('x').acquire()\n    with FileLock('y'):\n        pass\n"
                      "    subprocess.run(['true'], timeout=5)\n    p.wait(timeout=5)\n\n"
                      "def finish(r: subprocess.Popen):\n    r.wait()\n")
    lines = [int(w.split(":")[1]) for w in unbounded_waits(source)]
    assert sorted(lines) == [8, 10, 13, 14, 15, 21]
