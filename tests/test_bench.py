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
    """`python -m benchmarks.gpu` runs where neither FAISS, Prefect, MLflow, typer nor pydantic is installed (the lent GPU machines)."""
    code = ("import sys, benchmarks.gpu; print(sorted(m for m in ('faiss', 'prefect', 'mlflow', 'typer', 'pydantic') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_gpu_bench_dry_run_measures_every_section_through_the_device_paths(tmp_path):
    """`monim bench gpu --tiny` (its CPU dry run): every section; a scored pass and a decoding step read the host
    once, Θ decodes a prompt alike alone and among 16, the bare Decoder as transformers' own greedy search."""
    import torch

    from benchmarks import gpu

    out = tmp_path / "gpu.json"
    gpu.main(["--tiny", "--out", str(out)])
    saved = json.loads(out.read_text())["result"]
    assert saved["errors"] == {} and saved["measured"].startswith("a CPU dry run")
    assert list(saved["section_seconds"]) == ["knn-2000", "decode", "featurize", "knn-5000", "day", "parity"]
    for row in saved["knn"]:
        for name in ("device", "skip"):
            assert row["host_reads_per_pass"][name]["per_pass"] == 1, row["host_reads_per_pass"]
            assert row[f"knnlm_{name}_tokens"] > 0 and row[f"knnlm_{name}_ratio_to_bare"] > 0
        assert 0 < row["skipped_share"] < 1 and row["ppl_tokens"] > 0
    assert saved["lm"][0]["featurize"]["host_reads"]["per_pass"] == 1
    one, sixteen = saved["decode"]
    assert (one["rows"], sixteen["rows"]) == (1, 16)
    for row in (one, sixteen):
        assert row["bare"]["host_reads_per_step"] == row["theta"]["host_reads_per_step"] == 1
    assert one["theta"]["tokens"][0] == sixteen["theta"]["tokens"][0]
    assert one["theta"]["tokens"] != one["bare"]["tokens"]  # Θ mixed the memory in
    lm = gpu.random_lm("tiny", torch.device("cpu"), torch.float32)
    prompt = torch.tensor([[int(t) for t in one["bare"]["first_prompt"].split()]])
    greedy = lm.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=one["bare"]["new_tokens"],
                               do_sample=False, pad_token_id=0)
    assert greedy[0, prompt.shape[1]:].tolist() == one["bare"]["tokens"][0]
    assert saved["paper_day"]["tokens_measured"] > 0 and saved["parity"]["tokens"] > 0


def test_the_gpu_bench_skip_that_skips_nothing_leaves_theta_as_it_is():
    """A DeviceTheta whose skip threshold no λ is below scores every token as the one without the skip."""
    import numpy as np
    import torch

    from benchmarks import gpu

    lm = gpu.random_lm("tiny", torch.device("cpu"), torch.float32)
    keys, ids = gpu.random_keys(3000, lm.hidden_size, lm.device)
    index = gpu.TorchExact(keys, ids)
    values = gpu.memory_values(index, lm.model.config.vocab_size)
    calibrator, lam = gpu.calibrated(index, values, gpu.sample(lm, 512, seed=4))
    assert lam.min() > 0
    plain, none = (gpu.knnlm_tokens_per_s(lm, theta, 600, 600)[2] for theta in
                   (gpu.memory_on_device(index, values), gpu.memory_on_device(index, values, calibrator, 0.0)))
    assert not none["skipped"].any()
    np.testing.assert_allclose(none["theta_logp"], plain["theta_logp"], rtol=0, atol=1e-6)
    assert gpu.ppl_change(plain, none)["ppl_change_by_skip"] == 0


def test_the_gpu_bench_stops_an_unplanned_sync_and_lets_the_planned_reads_through():
    """Under the bench's sync check (torch.cuda's sync debug mode, "error"), monim.lm.host's reads read and an `.item()` raises (a GPU only)."""
    import pytest
    import torch

    from benchmarks import gpu
    from monim.lm.host import queued, to_host

    if not torch.cuda.is_available():
        pytest.skip("the sync debug mode is torch.cuda's")
    device, found = torch.device("cuda"), []
    x = torch.arange(6, device=device)
    with gpu.no_syncs(device, "error", found):
        assert to_host(x).tolist() == list(range(6)) and queued({"x": x * 2})()["x"].tolist() == list(range(0, 12, 2))
        with pytest.raises(RuntimeError, match="synchronizing"):
            x.sum().item()
    with gpu.no_syncs(device, "warn", found):
        x.sum().item()
    assert len(found) == 1 and torch.cuda.get_sync_debug_mode() == 0
