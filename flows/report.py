"""The report of an experiment's runs, read back from MLflow: markdown and PNGs in a folder."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from monim.report import render_report
from tasks.tracking import client, fetch_runs


@flow(name="monim-report")
def report_runs(experiment: str | None, tracking_uri: str, out: str) -> str:
    """Write `report.md` and its PNGs into `out` for every run of the experiment (None: the store's
    only one); returns its path."""
    if experiment is None:
        names = [e.name for e in client(tracking_uri).search_experiments() if e.name != "Default"]
        if len(names) != 1:
            raise ValueError(f"give --experiment: {tracking_uri} has {len(names)} experiments ({', '.join(names) or 'none'})")
        experiment = names[0]
    runs = fetch_runs(tracking_uri, experiment)
    markdown = render_report(runs, out, f"MoNIM report: {experiment}")
    path = Path(out) / "report.md"
    path.write_text(markdown)
    create_markdown_artifact(markdown, key="monim-report", description=f"{experiment} ({len(runs)} runs)")
    return str(path)
