"""A work directory and MLflow registry written by monim before its library was split into packages
(BEFORE, the last commit with the flat library, run from its own source in git) still opens,
resumes, registers, serves and passes fsck with this code; a version registered then answers as
`monim eval` as of its day does now."""

import io
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BEFORE = "18216b6af937fb19c2c3b5c303117d34340af30a"  # read-through mend (issue 57): the last commit before monim/ became packages
DAYS = ("1987-03-02", "1987-03-03", "1987-03-04")


def old_source(out: Path) -> Path:
    """monim, tasks and flows as BEFORE had them, from the repository's history."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", BEFORE, "monim", "tasks", "flows"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"the repository's history is needed for commit {BEFORE} (a shallow clone lacks it): "
                    f"{archive.stderr.decode()[:200]}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(out, filter="data")
    return out


@pytest.fixture(scope="module")
def old(monim, tiny_model_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """Two days learned by the old code (MoNIM-AMT, tracked and registered in MLflow), and the command that learns."""
    root = tmp_path_factory.mktemp("upgrade")
    code = old_source(root / "code")
    demo = code / "monim" / "data" / "reuters-1987-03-02_03-13.jsonl.gz"
    learn = ["learn", "--source", str(demo), "--start", DAYS[0], "--policy", "monim-amt", "--workdir", str(root / "w"),
             "--model", str(tiny_model_dir("llama")), "--max-docs", "3"]
    # the old packages come first on the path (the installed ones are found after them)
    proc = subprocess.run([sys.executable, "-c", "from flows.cli import app; app()", *learn, "--end", DAYS[1]],
                          cwd=code, env=monim.env() | {"PYTHONPATH": str(code)}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (code / "monim" / "theta").exists()  # it was the flat library
    return root / "w", learn


def test_an_old_work_directory_passes_fsck_resumes_and_registers(monim, old):
    workdir, learn = old
    assert monim("fsck", "--workdir", workdir, check=False).returncode == 0
    assert monim.json("status", "--workdir", workdir)["memories"]["monim-amt"]["days"] == 2
    monim(*learn, "--end", DAYS[2])  # resumed: the third day only
    status = monim.json("status", "--workdir", workdir)["memories"]["monim-amt"]
    assert (status["days"], status["last_day"]) == (3, DAYS[2])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    versions = client.search_model_versions()
    assert sorted(v.tags["monim.as_of"] for v in versions) == list(DAYS)  # two registered before, one now
    assert monim("fsck", "--workdir", workdir, check=False).returncode == 0


def test_a_version_registered_before_serves_as_eval_reads_its_day(monim, old, invoke, tmp_path):
    import servers.local as servers

    workdir, _ = old
    text = ("The company said its first quarter profits rose on higher sales of its products, and "
            "analysts said the shares would gain.")
    (tmp_path / "text.txt").write_text(text)
    by_eval = monim.json("eval", "--workdir", workdir, "--as-of", DAYS[0], "--text", tmp_path / "text.txt")
    port = servers.free_port()
    proc = servers.start([monim.script, "serve-model", "--workdir", str(workdir), "--version", "1", "--port", str(port)],
                         f"http://127.0.0.1:{port}/ping", env=monim.env())
    try:
        status, answer = invoke(port, {"dataframe_records": [{"text": text}]})
    finally:
        servers.stop([proc])
    assert status == 200, answer
    served = answer["predictions"][0]
    assert served["tokens"] == by_eval["text_tokens"] and math.isfinite(served["ppl"])
    assert served["ppl"] == pytest.approx(by_eval["ppl_text"], rel=1e-5)
