"""The dashboards as a user meets them: a comparison run from a fresh shell (its terminal quiet), its
MLflow experiment, and every page `monim ui` links, opened in a real headless browser."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import chromium
from monim.core.config import DEMO_STREAM

NOISE = re.compile(r"warning|deprecat|View at |Traceback", re.IGNORECASE)

pytestmark = pytest.mark.slow  # starts `monim compare`, the UIs and Chromium


@pytest.fixture(scope="module")
def compared(monim, tiny_model_dir, tmp_path_factory):
    """FullMem and MoNIM-AMT over three days, as `monim compare` from a fresh shell runs them (its
    output going to a pipe, as under a scheduler)."""
    workdir = tmp_path_factory.mktemp("dashboards")
    proc = subprocess.run([monim.script, "compare", "--source", str(DEMO_STREAM), "--start", "1987-03-02", "--end", "1987-03-04",
                           "--policies", "fullmem,monim-amt", "--workdir", str(workdir), "--model", tiny_model_dir("gpt2"),
                           "--max-docs", "2"], capture_output=True, text=True, timeout=900, env=monim.env(own_api=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir, proc


def test_the_terminal_is_quiet(monim, compared, tiny_model_dir):
    workdir, proc = compared
    out = proc.stdout + proc.stderr
    assert not NOISE.findall(out), [line for line in out.splitlines() if NOISE.search(line)]
    assert "\r" not in out  # no progress bar redrawn into a pipe: log lines at every 25% instead
    assert re.search(r"LM features 1987-03-02 train: 100% \(", out)
    assert out.count("flow runs are kept in") == 1  # where the records are, said once
    gen = subprocess.run([monim.script, "generate", "--workdir", str(workdir), "--policy", "monim-amt", "--prompt", "The dollar",
                          "--max-new-tokens", "3"], capture_output=True, text=True, timeout=300, env=monim.env(own_api=True))
    assert gen.returncode == 0 and not NOISE.findall(gen.stderr), gen.stderr[-3000:]


def test_the_experiment_reads_like_the_papers_tables(compared):
    from mlflow.tracking import MlflowClient

    workdir, _ = compared
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("monim-reuters-1987-03-02_03-13")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # MLflow 3's model-training mode
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"fullmem", "monim-amt", "comparison (report)"}
    for name in ("fullmem", "monim-amt"):
        metrics = runs[name].data.metrics
        assert {"1_results/ppl_so_far", "1_results/memrate_percent", "1_results/memory_mb", "3_quality/ppl",
                "3_quality/ppl_lm"} <= set(metrics)
        assert all("/" in k for k in metrics) and not any(k.endswith("/step") or k == "step" for k in metrics)
        assert runs[name].info.status == "FINISHED" and runs[name].info.end_time
    report = {a.path for a in client.list_artifacts(runs["comparison (report)"].info.run_id, "report")}
    assert {"report/report.md", "report/memory_growth.png"} <= report


def terminal_ppl(output: str, cell: int = 5) -> dict[str, float]:
    """Each policy's test PPL over all its days (or another cell of its row: 3, MemRate in percent), as
    `monim compare` printed it in its table."""
    out = {}
    for line in output.splitlines():
        cells = line.split()
        if cells and cells[0] in ("fullmem", "monim-amt") and len(cells) > 5 and cells[3].endswith("%"):
            out[cells[0]] = float(cells[cell].replace(",", "").removesuffix("%"))  # policy, days, entries, memrate, ppl_lm, ppl
    assert set(out) == {"fullmem", "monim-amt"}, output
    return out


def read_links(log: Path, proc: subprocess.Popen) -> dict[str, str]:
    """The links `monim ui` prints, once both servers answer."""
    deadline = time.time() + 240
    while "Ctrl-C" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(1)
    return dict(re.findall(r"^\s+(.+?): (http://\S+)$", log.read_text(), re.MULTILINE))


def test_the_pages_monim_ui_links_in_a_browser(monim, compared, tmp_path):
    workdir, _ = compared
    shots = Path(os.environ.get("MONIM_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "ui.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([monim.script, "ui", "--workdir", str(workdir), "--prefect-port", "0", "--mlflow-port", "0"],
                                env=monim.env(own_api=True), stdout=out, stderr=subprocess.STDOUT)
    try:
        links = read_links(log, proc)
        experiment = "monim-reuters-1987-03-02_03-13"
        assert {"Prefect flow runs", f"MLflow runs of {experiment}", f"MLflow charts of {experiment}",
                f"model versions of {experiment}-monim-amt"} <= set(links), links
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1920, "height": 1080})

            page.goto(links[f"MLflow runs of {experiment}"])
            header = page.locator("[role=columnheader]")
            header.filter(has_text="1_results/ppl_so_far").first.wait_for(timeout=60_000)

            def results_columns() -> tuple[list[str], list[str]]:
                columns = header.all_inner_texts()
                return columns, list(dict.fromkeys(c for c in columns if c.startswith("1_results/")))

            columns, order = results_columns()
            for _ in range(20):  # the grid draws its columns first, then (on most loads) the saved view's order
                if order[:1] == ["1_results/ppl_so_far"]:
                    break
                page.wait_for_timeout(500)
                columns, order = results_columns()
            page.screenshot(path=shots / "mlflow-runs.png")
            assert {"Duration", "1_results/ppl_so_far", "1_results/ppl_novel_so_far", "1_results/memrate_percent",
                    "1_results/memory_mb"} <= set(columns), columns
            # the saved view's columns: the results section's, and no other section's (MLflow 3.17 applies
            # their order on some loads only, so the order is not asserted)
            assert not [c for c in columns if "/" in c and not c.startswith("1_results/")], columns
            # each policy a row of its own, which shows what the terminal's table says it achieved over the
            # three days (the grid draws a row's pinned name and its metrics in two elements of one row-index)
            parts: dict[str, list[str]] = {}
            for index, text in page.locator("[role=row][row-index]").evaluate_all(
                    "els => els.map(e => [e.getAttribute('row-index'), e.innerText])"):
                parts.setdefault(index, []).append(text)
            whole = ["\n".join(p) for p in parts.values()]
            printed = compared[1].stdout + compared[1].stderr
            for name, ppl in terminal_ppl(printed).items():
                row = next(r for r in whole if re.search(rf"(^|\s){re.escape(name)}(\s|$)", r))
                numbers = {float(x.replace(",", "")) for x in re.findall(r"\d[\d,]*\.?\d*", row)}
                assert ppl in numbers and terminal_ppl(printed, 3)[name] in numbers, (name, ppl, row)  # PPL, MemRate %

            page.goto(links[f"MLflow report run of {experiment}"])  # the comparison's run: the same table
            page.get_by_text("side by side", exact=False).first.wait_for(timeout=60_000)
            page.screenshot(path=shots / "mlflow-report-run.png")
            body = page.inner_text("body")
            for name, ppl in terminal_ppl(compared[1].stdout + compared[1].stderr).items():
                assert re.search(rf"{re.escape(name)}\s+3\s", body) and f"{name}/ppl" in body, body[:3000]
                assert f"{ppl:,.0f}" in body if ppl >= 1000 else f"{ppl:#.4g}" in body

            page.goto(links[f"MLflow charts of {experiment}"])
            page.locator("h4[title='1_results/ppl_so_far']").first.wait_for(timeout=60_000)
            page.wait_for_timeout(2000)
            page.screenshot(path=shots / "mlflow-charts.png")
            titles = page.locator("h4[title]").evaluate_all("els => els.map(e => e.title)")
            first = [t for t in titles[: next((i for i, t in enumerate(titles) if "/" in t and not t.startswith("1_results/")),
                                              len(titles))] if "/" in t]
            assert first[0].startswith("1_results/") and {"1_results/ppl_so_far", "1_results/memrate_percent"} <= set(first), titles
            text = page.inner_text("body")
            assert "Time" in text  # charts over the stream's days
            sections = [s for s in ("1_results", "2_learned", "5_calibration", "8_data") if s in text]
            assert sections[0] == "1_results" and sorted(sections, key=text.index) == sections

            page.goto(links[f"model versions of {experiment}-monim-amt"])
            page.get_by_text("Version 1", exact=False).first.wait_for(timeout=60_000)
            page.screenshot(path=shots / "mlflow-models.png")
            assert "champion" in page.inner_text("body")

            page.goto(links["Prefect flow runs"])
            try:
                page.get_by_text("monim-day", exact=False).first.wait_for(timeout=60_000)
            finally:
                page.screenshot(path=shots / "prefect-runs.png")
            body = page.inner_text("body")  # the UI reaches its own API (not the default port's)
            assert "monim-compare" in body and "Can't connect to Server API" not in body
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
