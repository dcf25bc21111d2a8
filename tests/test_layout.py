"""The code's shape: imports point flows → tasks → monim with no cycle, the library never imports
Prefect or MLflow, and no file grows past one idea (~400 lines)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"monim": 0, "tasks": 1, "flows": 2}


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


def test_the_library_never_imports_prefect_or_mlflow():
    wrong = [(m, i) for m, found in module_imports().items() if m.startswith("monim") for i in found
             if i.split(".")[0] in ("prefect", "mlflow", "prefect_dask")]
    assert not wrong


def test_no_file_holds_two_ideas():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for package in (*LAYERS, "tests", "benchmarks") for p in (REPO / package).rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > 420} == {}
