"""The report of an experiment's runs, read back from MLflow: markdown and PNGs in a folder."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from monim.evaluation.report import render_report
from tracking.runs import fetch_runs, log_folder
from tracking.store import client


def write_report(experiment: str | None, tracking_uri: str, out: str) -> tuple[str, str]:
    """Write `report.md` and its PNGs into `out` for every policy run of the experiment (None: the
    store's only one); its path and markdown. A plain function: `monim report` runs no Prefect flow."""
    if experiment is None:
        names = [e.name for e in client(tracking_uri).search_experiments() if e.name != "Default"]
        if len(names) != 1:
            raise ValueError(f"give --experiment: {tracking_uri} has {len(names)} experiments ({', '.join(names) or 'none'})")
        experiment = names[0]
    runs = fetch_runs.fn(tracking_uri, experiment)
    markdown = render_report(runs, out, f"MoNIM report: {experiment}")
    path = Path(out) / "report.md"
    path.write_text(markdown)
    return str(path), markdown


@flow(name="monim-report")
def report_runs(experiment: str | None, tracking_uri: str, out: str, run_id: str | None = None) -> str:
    """The report (see write_report), also a Prefect artifact and, with `run_id` (a comparison's run),
    logged to that MLflow run so its figures open in the UI; returns its path."""
    path, markdown = write_report(experiment, tracking_uri, out)
    create_markdown_artifact(markdown, key="monim-report", description=f"{experiment}")
    if run_id:
        log_folder(run_id, tracking_uri, out, "report")
    return path
