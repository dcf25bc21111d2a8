"""Several policies over the same days, into one MLflow experiment, with a comparison table."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.evaluate import evaluate_runs
from flows.report import report_runs
from flows.stream import learn_stream, stream_config
from monim.report import summarize
from tasks.tracking import experiment_name, tracking_uri as resolve_tracking_uri

POLICIES = ["bare", "fullmem", "randmem", "monim", "monim-amt"]


@flow(name="monim-compare")
def compare_policies(source: str, start: str | None = None, end: str | None = None, policies: list[str] | None = None,
                     workdir: str = "monim-work", model: str | None = None, max_docs: int | None = None,
                     seed: int = 0, experiment: str | None = None, tracking_uri: str | None = None,
                     calibrated: bool = True, calibrator_params: dict | None = None,
                     evaluation: dict | None = None) -> dict[str, dict]:
    """Run each policy over the same days (RandMem stores at MoNIM's rate when MoNIM runs too), run
    the evaluation suite (monim.evaluate.EvalConfig) over them, and write the report."""
    policies = policies or POLICIES
    order = sorted(policies, key=lambda p: p != "monim-amt" and p != "monim")  # MoNIM first, for RandMem's rate
    summary: dict[str, dict] = {}
    configs: dict[str, dict] = {}
    for policy in order:
        params = {}
        if policy == "randmem":
            monim = summary.get("monim-amt") or summary.get("monim")
            params = {"rate": round(monim["memrate"], 4)} if monim else {}
        rows = learn_stream(source, start, end, policy, workdir, model, max_docs, params, seed, experiment, tracking_uri,
                            calibrated, calibrator_params)
        summary[policy] = summarize(rows)
        configs[policy] = stream_config(source, policy, workdir, model, max_docs, params, seed, calibrated, calibrator_params)
    table = [{"policy": p} | {k: round(v, 4) if isinstance(v, float) else v for k, v in summary[p].items()} for p in policies]
    create_table_artifact(table, key="monim-comparison", description=f"{source} {start}..{end}")
    if evaluation:
        evaluate_runs([configs[p] for p in policies], start, end, evaluation, experiment, tracking_uri)
    report_runs(experiment or experiment_name(source), resolve_tracking_uri(workdir, tracking_uri),
                str(Path(workdir) / "report"))
    return {p: summary[p] for p in policies}
