"""Several policies over the same days, into one MLflow experiment, with a comparison table."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.evaluate import evaluate_runs
from flows.report import report_runs
from flows.stream import as_date, learn_stream
from monim.core import catalogue
from monim.core.config import EvalConfig
from monim.core.run_config import RunConfig
from monim.evaluation.report import policies_table
from monim.evaluation.totals import summarize
from monim.plan import plan
from tracking.runs import ended, experiment_name, fetch_runs, log_side_by_side, open_comparison
from tracking.store import tracking_uri as resolve_tracking_uri


@flow(name="monim-compare")
def compare_policies(run: RunConfig, start: str | None = None, end: str | None = None, policies: list[str] | None = None,
                     experiment: str | None = None, tracking_uri: str | None = None,
                     evaluation: EvalConfig | None = None, wait: bool = True) -> dict[str, dict]:
    """Run each policy over the same days with the run's settings (RandMem stores at MoNIM's rate
    when MoNIM runs too), run the evaluation suite over them, and write the report. `wait`: as in
    learn_stream. Every policy's range is planned before any work (monim.plan), the feed read once for all."""
    policies = policies or list(catalogue.COMPARED)
    for policy in policies:
        plan(run.model_copy(update={"policy": policy}), as_date(start), as_date(end))
    experiment, uri = experiment or experiment_name(run.source), resolve_tracking_uri(run.workdir, tracking_uri)
    summary: dict[str, dict] = {}
    runs: dict[str, RunConfig] = {}
    comparison = open_comparison(run, experiment, uri)
    with ended(comparison, uri, lambda: f"{', '.join(policies)} on `{Path(run.source).name}`, side by side (the report "
                                    "is among this run's artifacts):\n\n" + policies_table(fetch_runs.fn(uri, experiment))):
        for policy in catalogue.learning_order(policies):
            follows = catalogue.followed_memrate(policy, {p: s["memrate"] for p, s in summary.items()})
            runs[policy] = RunConfig.model_validate(run.model_dump() | {"policy": policy, "followed_memrate": follows})
            summary[policy] = summarize(learn_stream(runs[policy], start, end, experiment, uri, wait=wait, comparison=comparison))
        table = [{"policy": p} | {k: round(v, 4) if isinstance(v, float) else v for k, v in summary[p].items()}
                 for p in policies]
        create_table_artifact(table, key="monim-comparison", description=f"{run.source} {start}..{end}")
        log_side_by_side(comparison, uri, summary)
        if evaluation:
            evaluate_runs([runs[p] for p in policies], start, end, evaluation, experiment, uri)
        report_runs(experiment, uri, str(Path(run.workdir) / "report"), comparison)
    return {p: summary[p] for p in policies}
