"""The code's shape: imports point flows → tasks → monim with no cycle, inside monim down its layers
(learning and evaluation side by side, never importing each other), the library never imports
Prefect or MLflow, and no file grows past one idea (~400 lines)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"monim": 0, "tasks": 1, "flows": 2}
# monim's packages, lowest first; a module directly in monim/ (run.py, status.py) sits on top of them all
FLOORS = {"core": 0, "data": 1, "lm": 2, "storage": 3, "theta": 4, "learning": 5, "evaluation": 5, "serving": 6}
TOP = max(FLOORS.values()) + 1


def module_imports() -> dict[str, set[str]]:
    """Each project module (dotted name) -> the project and third-party modules it imports, anywhere in it."""
    out = {}
    for package in LAYERS:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            out[name] = found
    return out


def project_graph() -> dict[str, set[str]]:
    imports = module_imports()
    return {m: {i for i in found if i in imports and i != m} for m, found in imports.items()}


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


def test_imports_point_from_flows_to_tasks_to_the_library():
    wrong = [(m, i) for m, found in project_graph().items() for i in found
             if LAYERS[i.split(".")[0]] > LAYERS[m.split(".")[0]]]
    assert not wrong


def floor(module: str) -> tuple[int, str]:
    """(floor, package) of a monim module: monim.storage.index -> (3, "storage"); monim.run -> (TOP, "")."""
    parts = module.split(".")
    return (FLOORS[parts[1]], parts[1]) if len(parts) > 1 and parts[1] in FLOORS else (TOP, "")


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """monim's imports that climb a floor, or cross to another package on the same floor."""
    wrong = []
    for m, found in graph.items():
        if not m.startswith("monim."):
            continue
        for i in found:
            if i.startswith("monim.") and floor(i) != floor(m) and floor(i)[0] >= floor(m)[0]:
                wrong.append((m, i))
    return sorted(wrong)


def test_the_library_imports_only_down_its_layers():
    assert layer_violations(project_graph()) == []


def test_the_layer_rule_catches_a_climb_and_a_crossing():
    assert layer_violations({"monim.storage.index": {"monim.learning.parametric", "monim.core.atomic"},
                             "monim.learning.memorize": {"monim.evaluation.evaluate", "monim.theta.memory"},
                             "monim.run": {"monim.learning.memorize"}}) == [
        ("monim.learning.memorize", "monim.evaluation.evaluate"), ("monim.storage.index", "monim.learning.parametric")]


def test_every_package_says_what_it_holds_and_may_import():
    for package in FLOORS:
        doc = ast.get_docstring(ast.parse((REPO / "monim" / package / "__init__.py").read_text()))
        assert doc and "Imports" in doc, package


def test_the_library_never_imports_prefect_or_mlflow():
    wrong = [(m, i) for m, found in module_imports().items() if m.startswith("monim") for i in found
             if i.split(".")[0] in ("prefect", "mlflow", "prefect_dask")]
    assert not wrong


def test_no_file_holds_two_ideas():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for package in (*LAYERS, "tests", "benchmarks") for p in (REPO / package).rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > 420} == {}


def test_no_class_holds_two_ideas():
    """A class past ~200 lines is usually two ideas (Memory and Datastore were split along theirs)."""
    sizes = {f"{p.relative_to(REPO)}:{n.name}": n.end_lineno - n.lineno + 1 for package in LAYERS
             for p in (REPO / package).rglob("*.py") for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)}
    assert {c: n for c, n in sizes.items() if n > 250} == {}
