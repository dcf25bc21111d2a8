"""The code's shape: each package's layer and what it may import, as data (UNITS), checked on every import
in monim/, tracking/, tasks/, flows/, servers/, cli/ and benchmarks/ (relative, lazy, `importlib` and TYPE_CHECKING ones too);
no cycle between modules; the library never imports Prefect or MLflow; and importing the code sets no environment."""

import ast
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("monim", "tracking", "tasks", "flows", "servers", "cli", "benchmarks")

# The layer rule. Each package (or module standing for itself) -> (its layer, the units it may import). A unit
# may import its own modules, the units it lists, and what those may import in turn; a listed unit sits on a
# lower layer. A package missing here fails the test: declare it here, in the commit that adds it.
Units = dict[str, tuple[int, tuple[str, ...]]]
UNITS: Units = {
    "monim.core": (0, ()),
    "monim.data": (1, ("monim.core",)),
    "monim.lm": (2, ("monim.data",)),
    "monim.storage": (3, ("monim.lm",)),
    "monim.theta": (4, ("monim.storage",)),
    "monim.learning": (5, ("monim.theta",)),  # learning and evaluation side by side, never importing each other
    "monim.evaluation": (5, ("monim.theta",)),
    "monim.serving": (6, ("monim.evaluation",)),  # never monim.learning
    "monim": (7, ("monim.learning", "monim.serving")),  # run.py and status.py on top, and the public names
    "tasks.logs": (8, ()),  # the task's logger: Prefect's, which MLflow's store lock writes to too
    "tracking": (9, ("monim", "tasks.logs")),
    "tasks": (10, ("tracking",)),
    "tasks.tracking": (10, ("tracking",)),  # the import path of versions registered by monim 0.2.0
    "servers": (11, ("tracking",)),
    "flows": (11, ("tasks",)),
    "benchmarks.catalogue": (0, ()),  # the benches as data, which `monim bench` reads (it imports a bench by name)
    "cli": (12, ("flows", "servers", "benchmarks.catalogue")),
    "benchmarks": (13, ("cli",)),
}


def modules(root: Path) -> dict[str, Path]:
    """Each module of the tree under root (dotted name: monim.storage.index, monim.storage) -> its file."""
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for top in ROOTS if (root / top).is_dir() for p in sorted((root / top).rglob("*.py"))}


def packages(root: Path) -> dict[str, Path]:
    """Each package of the tree (a folder holding Python files, with or without __init__.py) -> its folder."""
    return {".".join(p.parent.relative_to(root).parts): p.parent
            for top in ROOTS if (root / top).is_dir() for p in (root / top).rglob("*.py")}


def imported(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, absolute module name) of everything a module imports, anywhere in it: `import`, `from`
    (relative ones resolved; `from a import b` names a.b where that is a module), and importlib's
    `import_module` or `__import__` called with a literal name."""
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def absolute(name: str, level: int, package: str = here) -> str:
        if not level:
            return name
        base = package.split(".")[:len(package.split(".")) - level + 1]
        return ".".join([*base, name] if name else base)

    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node.module or "", node.level)
            out += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base) for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(name := node.args[0].value, str)
              and (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))
              in ("import_module", "__import__")):
            level = len(name) - len(name.lstrip("."))
            anchor = node.args[1] if len(node.args) > 1 else None  # import_module(".x", "a.b"); else __package__
            package = anchor.value if isinstance(anchor, ast.Constant) and isinstance(anchor.value, str) else here
            out.append((node.lineno, absolute(name[level:], level, package)))
    return out


def unit(module: str, units: Units) -> str | None:
    """The declared unit a module belongs to: the longest declared name it is or lies inside."""
    return max((u for u in units if module == u or module.startswith(u + ".")), key=len, default=None)


def reach(name: str, units: Units) -> set[str]:
    """The units a unit may import: itself, those it lists (below it), and what they may import."""
    return {name}.union(*(reach(u, units) for u in units[name][1] if u in units and units[u][0] < units[name][0]))


def layer_violations(root: Path, units: Units = UNITS) -> list[str]:
    """What breaks the layer rule in the tree under root: a package with no declaration or no docstring,
    a declaration naming no unit or one not below it, and each import of a unit the importer may not reach."""
    mods, wrong = modules(root), []
    for package, folder in sorted(packages(root).items()):
        if package not in units:
            wrong.append(f"{package}: a package with no entry in UNITS (its layer and what it may import)")
        init = folder / "__init__.py"
        if not (init.exists() and ast.get_docstring(ast.parse(init.read_text()))):
            wrong.append(f"{package}: no docstring saying what the package holds ({init.relative_to(root)})")
    for name, (layer, listed) in units.items():
        if name not in mods:
            wrong.append(f"{name}: declared in UNITS, but no such package or module")
        wrong += [f"{name} lists {u}, which is not declared" for u in listed if u not in units]
        wrong += [f"{name} (layer {layer}) lists {u} (layer {units[u][0]}), not below it"
                  for u in listed if u in units and units[u][0] >= layer]
    for module, path in mods.items():
        if (own := unit(module, units)) is None:
            continue
        allowed = reach(own, units)
        for line, target in imported(module, path, set(mods)):
            if target.split(".")[0] in ROOTS and (to := unit(target, units)) not in allowed:
                wrong.append(f"{path.relative_to(root)}:{line}: {own} imports {target} ({to or 'undeclared'}), "
                             f"which it may not")
    return wrong


def test_every_import_keeps_to_the_layer_rule():
    assert layer_violations(REPO) == []


def project_graph() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports (a package counts as its __init__)."""
    mods = modules(REPO)
    return {m: {t for _, t in imported(m, p, set(mods)) if t in mods and t != m} for m, p in mods.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph, if it has one (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def test_the_import_graph_has_no_cycle():
    assert cycle(project_graph()) is None, cycle(project_graph())


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the project's Python files, which passes the rule."""
    root = tmp_path_factory.mktemp("tree")
    for path in modules(REPO).values():
        (root / path.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / path.relative_to(REPO))
    assert layer_violations(root) == []
    return root


TC = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    "


@pytest.mark.parametrize("file, text, said", [
    ("monim/storage/bad.py", "from ..learning import policies\n",
     "monim/storage/bad.py:1: monim.storage imports monim.learning.policies (monim.learning)"),
    ("monim/storage/bad.py", "from .. import run\n", "monim/storage/bad.py:1: monim.storage imports monim.run (monim)"),
    ("monim/lm/bad.py", "import importlib\n\nmodel = importlib.import_module('monim.theta.memory')\n",
     "monim/lm/bad.py:3: monim.lm imports monim.theta.memory (monim.theta)"),
    ("monim/lm/bad.py", "from importlib import import_module\n\nmemory = import_module('..theta.memory', __package__)\n",
     "monim/lm/bad.py:3: monim.lm imports monim.theta.memory (monim.theta)"),
    ("monim/core/bad.py", "def later():\n    return __import__('monim.data.stream')\n",
     "monim/core/bad.py:2: monim.core imports monim.data.stream (monim.data)"),
    ("monim/data/bad.py", TC + "from monim.lm.model import LM\n",
     "monim/data/bad.py:4: monim.data imports monim.lm.model (monim.lm)"),
    ("monim/serving/bad.py", "from monim.learning.policies import POLICIES\n",
     "monim/serving/bad.py:1: monim.serving imports monim.learning.policies (monim.learning)"),
    ("monim/learning/bad.py", "from monim.evaluation import evaluate\n",
     "monim/learning/bad.py:1: monim.learning imports monim.evaluation.evaluate (monim.evaluation)"),
    ("monim/extra/__init__.py", '"""Extra."""\n\nfrom monim.run import open_run\n',
     "monim.extra: a package with no entry in UNITS"),
    ("monim/extra/x.py", "", ("monim.extra: a package with no entry in UNITS",
                              "monim.extra: no docstring saying what the package holds (monim/extra/__init__.py)")),
    ("monim/core/__init__.py", "", "monim.core: no docstring saying what the package holds (monim/core/__init__.py)"),
    ("tasks/bad.py", "from flows.day import learn_day\n", "tasks/bad.py:1: tasks imports flows.day (flows)"),
    ("tracking/bad.py", "from tasks import feed\n",
     "tracking/bad.py:1: tracking imports tasks.feed (tasks)"),
    ("servers/bad.py", "from cli.errors import NO_ROOM\n",
     "servers/bad.py:1: servers imports cli.errors (cli)"),
    ("flows/day2.py", "import servers.local\n", "flows/day2.py:1: flows imports servers.local (servers)"),
])
def test_each_kind_of_violation_fails_the_rule(tree, tmp_path, file, text, said):
    root = tmp_path / "tree"
    shutil.copytree(tree, root)
    (root / file).parent.mkdir(parents=True, exist_ok=True)
    (root / file).write_text(text)
    said = (said,) if isinstance(said, str) else said
    wrong = layer_violations(root)
    assert len(wrong) == len(said) and all(w.startswith(s) for w, s in zip(wrong, said)), wrong


@pytest.mark.parametrize("change, said", [
    ({"monim.core": (0, ("monim.data",))}, "monim.core (layer 0) lists monim.data (layer 1), not below it"),
    ({"monim.storage": (3, ("monim.lm", "monim.cache"))}, "monim.storage lists monim.cache, which is not declared"),
    ({"monim.cache": (3, ())}, "monim.cache: declared in UNITS, but no such package or module"),
])
def test_a_declaration_that_climbs_or_names_nothing_fails(tree, change, said):
    assert layer_violations(tree, {**UNITS, **change}) == [said]


def test_the_library_never_imports_prefect_or_mlflow():
    mods = modules(REPO)
    wrong = [(m, i) for m, p in mods.items() if m.startswith("monim") for _, i in imported(m, p, set(mods))
             if i.split(".")[0] in ("prefect", "mlflow", "prefect_dask")]
    assert not wrong


def test_importing_the_code_sets_no_environment_and_no_logging():
    """Entry points set the environment (monim.core.environment); importing any of the code sets none of it
    and configures no logger."""
    import subprocess
    import sys

    from monim.core.environment import DEFAULTS

    # MLflow loads tracking.theta_model; a bench is an entry point (benchmarks.harness sets the environment)
    names = sorted(m for m in modules(REPO) if m != "tracking.theta_model" and not m.startswith("benchmarks"))
    code = ("import importlib, logging, os, sys\nbefore = dict(os.environ)\n"
            f"for m in {names!r}: importlib.import_module(m)\n"
            "print(sorted(k for k in os.environ if os.environ.get(k) != before.get(k) and "
            "(k in sys.argv[1:] or k.startswith('MONIM'))))\n"
            "print(sorted(n for n, g in logging.root.manager.loggerDict.items() "
            "if isinstance(g, logging.Logger) and g.level and (n.startswith('monim') or n == 'bm25s')))")
    env = {k: v for k, v in os.environ.items() if k not in DEFAULTS}
    out = subprocess.run([sys.executable, "-c", code, *DEFAULTS], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout
