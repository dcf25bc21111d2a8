"""`monim bench`: the catalogue names every bench in benchmarks/, a bench runs with its own options and
writes its result with an envelope, an unknown bench is refused."""

import ast
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from benchmarks.catalogue import BENCHES, NEEDS
from cli import app

REPO = Path(__file__).resolve().parents[1]
MONIM = str(Path(sys.executable).parent / "monim")


def test_the_list_names_every_bench_in_benchmarks_and_nothing_else():
    """No script in benchmarks/ is left outside the command (harness and catalogue are the framework)."""
    modules = {p.stem for p in (REPO / "benchmarks").glob("*.py")} - {"__init__", "harness", "catalogue"}
    assert {b.module for b in BENCHES.values()} == modules
    out = CliRunner().invoke(app, ["bench", "--list"])
    assert out.exit_code == 0, out.output
    listed = {line.split()[0]: line for line in out.output.splitlines()}
    assert set(listed) == set(BENCHES)
    for name, bench in BENCHES.items():
        assert name == bench.module.replace("_", "-") and set(bench.needs) <= set(NEEDS) and bench.minutes > 0
        doc = ast.get_docstring(ast.parse((REPO / "benchmarks" / f"{bench.module}.py").read_text()))
        assert doc and doc.split("\n")[0] in listed[name], name  # its description, the docstring's first line
        source = (REPO / "benchmarks" / f"{bench.module}.py").read_text()
        assert "def main(argv: list[str] | None = None) -> None:" in source, name


def test_an_unknown_bench_is_refused_naming_the_benches():
    out = CliRunner().invoke(app, ["bench", "no-such-bench"])
    assert out.exit_code == 2
    assert "no bench 'no-such-bench'" in out.output and all(name in out.output for name in BENCHES)


def test_a_bench_runs_with_its_own_options_and_writes_its_envelope(tmp_path):
    """verify-cost on 1,000 entries, as a user runs it: its options after its name untouched (--help too), its
    result in an envelope that says what made it; harness.resume reads the result back."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                        "OMP_NUM_THREADS": "1"}
    helped = subprocess.run([MONIM, "bench", "verify-cost", "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: monim bench verify-cost"), helped.stdout
    out = tmp_path / "result.json"
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    proc = subprocess.run([MONIM, "bench", "verify-cost", "--entries", "1000", "--out", str(out)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert saved["bench"] == "verify-cost"
    assert saved["command"] == f"monim bench verify-cost --entries 1000 --out {out}"
    assert saved["commit"] == commit and isinstance(saved["dirty"], bool)
    assert saved["machine"]["cores"] == os.cpu_count() and saved["machine"]["cpu"] and "gpu" in saved["machine"]
    assert saved["versions"]["python"] == platform.python_version() and "numpy" in saved["versions"]
    assert saved["options"] == {"out": str(out), "entries": [1000], "work": None}
    started, ended = dt.datetime.fromisoformat(saved["started"]), dt.datetime.fromisoformat(saved["ended"])
    assert before <= started <= ended
    assert [r["entries"] for r in saved["result"]["rows"]] == [1000]
    from benchmarks.harness import resume

    assert resume(out, {}) == saved["result"] and resume(tmp_path / "none.json", {"rows": []}) == {"rows": []}


def test_the_gpu_bench_imports_nothing_a_lent_gpu_machine_lacks():
    """`python -m benchmarks.gpu` runs where neither FAISS, Prefect, MLflow nor typer is installed (the lent GPU machines)."""
    code = ("import sys, benchmarks.gpu; print(sorted(m for m in ('faiss', 'prefect', 'mlflow', 'typer') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
