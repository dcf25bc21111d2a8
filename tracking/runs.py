"""MLflow tracking: an experiment per stream, a run per policy, metrics per day (step = day index)."""

from __future__ import annotations

import csv
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from prefect import task
from prefect.cache_policies import NO_CACHE

from monim.core.config import DEFAULT_MODEL
from monim.core.run_config import RunConfig
from monim.data.stream import list_dates
from monim.run import make_run
from monim.storage import workdirs
from tracking.charts import NOT_LOGGED, VIEW, VIEW_TAG, row_key, saved_view
from tracking.logged import MARK, log_metrics, logged_steps, memory_runs, side_by_side
from tracking.store import client, one_at_a_time

KIND = "mlflow.experimentKind"
COMPARISON = "monim.comparison"


def experiment_name(source: str) -> str:
    """The default MLflow experiment of a stream: one per source."""
    return "monim-" + Path(source.removeprefix("hf:")).name.split(".")[0]


def experiment_id(uri: str, name: str, workdir: str) -> str:
    """The experiment's id, created on first use (artifacts inside the work directory for SQLite) as
    a model-training experiment (MLflow 3's UI would open a GenAI one) with monim's saved view."""
    c = client(uri)
    found = c.get_experiment_by_name(name)
    if found is None:
        location = (Path(workdir).resolve() / "mlartifacts" / name).as_uri() if uri.startswith("sqlite") else None
        found = c.get_experiment(c.create_experiment(name, artifact_location=location))
    if KIND not in found.tags or VIEW_TAG not in found.tags:  # also for experiments made before these
        c.set_experiment_tag(found.experiment_id, KIND, "custom_model_development")
        c.set_experiment_tag(found.experiment_id, VIEW_TAG, saved_view())
    return found.experiment_id


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
def run_params(cfg: RunConfig) -> dict:
    """The run's settings as MLflow's flat parameters: the policy's as it learns with them, the
    learner's or the calibrator's as dotted names."""
    return make_run(cfg).params()


@one_at_a_time
def mlflow_run(cfg: RunConfig, experiment: str, uri: str, comparison: str | None = None) -> tuple[str, str]:
    """The MLflow run of this policy on this work directory, resumed (RUNNING again) if it exists,
    else created; tagged with `comparison`, the run that groups a comparison, if given (a tag: MLflow's
    parent link would fold the policies' rows away in the runs table); and its origin, the date of step 0:
    the stream's first day, tagged once when the run is created (so that a step always names the
    same date, and readers can turn steps back into dates)."""
    c = client(uri)
    memory = str(workdirs.memory_root(cfg.workdir, cfg.name).resolve())
    runs = memory_runs(c, memory, 1)  # in any experiment: a renamed source keeps its run and experiment
    exp = runs[0].info.experiment_id if runs else experiment_id(uri, experiment, cfg.workdir)
    if runs:
        run_id = runs[0].info.run_id
        if runs[0].info.status != "RUNNING":
            c.update_run(run_id, status="RUNNING")
        if comparison is not None:
            c.set_tag(run_id, COMPARISON, comparison)
        origin = runs[0].data.tags.get("monim.origin")
        if origin is None:  # a run made before origins were tagged at creation
            origin = list_dates(cfg.source, on_error=cfg.on_error, fields=cfg.fields())[0].isoformat()
            c.set_tag(run_id, "monim.origin", origin)
        return run_id, origin
    origin = list_dates(cfg.source, on_error=cfg.on_error, fields=cfg.fields())[0].isoformat()
    tags = {"monim.memory": memory, "monim.policy": cfg.policy, "monim.source": cfg.source,
            "monim.model": cfg.model or "default", "monim.origin": origin} | ({COMPARISON: comparison} if comparison else {})
    run = c.create_run(exp, run_name=cfg.name, tags=tags)
    from mlflow.entities import Param

    c.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in run_params(cfg).items()])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(cfg.model_dump_json(indent=1))
        c.log_artifact(run.info.run_id, str(path))
    return run.info.run_id, origin


@contextmanager
def ended(run_id: str, uri: str, note: Callable[[], str]) -> Iterator[None]:
    """An invocation's MLflow run, ended with it: FINISHED (the runs table shows its duration), FAILED
    on an error or KILLED on a stop; `note()` is its description, said at the end."""
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit):
        status = "KILLED"
        raise
    finally:
        close_run(run_id, uri, status, note())


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def close_run(run_id: str, uri: str, status: str, note: str) -> None:
    """End the run with this status and description."""
    c = client(uri)
    c.set_tag(run_id, "mlflow.note.content", note)
    c.set_terminated(run_id, status)


def describe(cfg: RunConfig) -> str:
    """What a policy's run is: the policy, the stream, the days learned so far, the model."""
    days = sorted(workdirs.read_rows(cfg.workdir, cfg.name))
    return (f"**{cfg.name}** on `{Path(cfg.source).name}`: {len(days)} days learned"
            + (f", {days[0]} .. {days[-1]}" if days else "") + f"; model `{cfg.model or DEFAULT_MODEL}`"
            + (f", at most {cfg.max_docs} training articles a day" if cfg.max_docs else ", every article"))


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def open_comparison(cfg: RunConfig, experiment: str, uri: str) -> str:
    """The run that groups a comparison in this work directory's experiment (its policies' runs carry
    its id in their `monim.comparison` tag), resumed (RUNNING again) if it exists; the report is
    logged to it."""
    c = client(uri)
    exp = experiment_id(uri, experiment, cfg.workdir)
    where = str(Path(cfg.workdir).resolve())
    runs = c.search_runs([exp], filter_string=f"tags.`monim.kind` = 'comparison' and tags.`monim.workdir` = '{where}'",
                         max_results=1)
    if runs:
        c.update_run(runs[0].info.run_id, status="RUNNING")
        return runs[0].info.run_id
    tags = {"monim.kind": "comparison", "monim.workdir": where, "monim.source": cfg.source,
            "monim.model": cfg.model or DEFAULT_MODEL}
    return c.create_run(exp, run_name="comparison (report)", tags=tags).info.run_id


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def log_day(run_id: str, uri: str, step: int, row: dict) -> bool:
    """Log one day's numeric metrics at step = day index (and the day's date as their time), once (a
    re-run logs nothing again)."""
    c = client(uri)
    if step in logged_steps(c, run_id, MARK):
        return False
    log_metrics(c, run_id, [(k, step, v) for k, v in row.items() if k not in NOT_LOGGED])
    return True


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def log_points(run_id: str, uri: str, points: list[tuple[str, int, float]]) -> int:
    """Log (metric, step, value) points not logged yet at that step; returns how many were new."""
    c = client(uri)
    have: dict[str, set[int]] = {}
    for key, _, _ in points:
        if key not in have:
            have[key] = set(logged_steps(c, run_id, key))
    return log_metrics(c, run_id, [(k, step, v) for k, step, v in points if step not in have[k]])


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def metric_steps(run_id: str, uri: str, keys: list[str]) -> dict[str, list[int]]:
    """The steps at which each of these metrics is logged in the run."""
    c = client(uri)
    return {k: sorted(set(logged_steps(c, run_id, k))) for k in keys}


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def log_summary(run_id: str, uri: str, rows: list[dict]) -> None:
    """The per-day CSV and the plots (memory growth vs FullMem, PPL over days) as run artifacts."""
    if not rows:
        return
    c = client(uri)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "days.csv"
        fields = sorted({k for r in rows for k in r})
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows(rows)
        c.log_artifact(run_id, str(path))
        from monim.evaluation.plots import (  # matplotlib: only where a run's charts are drawn
            memory_growth,
            ppl_over_days,
        )

        for name, figure in (("memory_growth.png", memory_growth(rows)), ("ppl.png", ppl_over_days(rows))):
            figure.savefig(Path(tmp) / name, dpi=100, bbox_inches="tight")
            c.log_artifact(run_id, str(Path(tmp) / name), artifact_path="plots")


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def log_side_by_side(run_id: str, uri: str, summary: dict[str, dict]) -> None:
    """A comparison's run: each policy's totals as metrics (tracking.logged.side_by_side)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client(uri).log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in side_by_side(summary).items()])


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def log_folder(run_id: str, uri: str, folder: str, artifact_path: str) -> None:
    """A folder's files (a report: markdown and figures) as the run's artifacts."""
    client(uri).log_artifacts(run_id, folder, artifact_path)


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def fetch_runs(uri: str, experiment: str) -> dict[str, dict]:
    """Every run of an experiment: {name: {"tags", "params", "metrics": {key: [(step, value)]}}}."""
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"no MLflow experiment {experiment!r} at {uri}")
    out = {}
    for run in c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]):
        if run.data.tags.get("monim.kind") == "comparison":  # the run that groups a comparison, no policy's
            continue
        metrics: dict[str, list] = {}
        for name in run.data.metrics:  # by the rows' keys, whether logged in sections or before them
            metrics.setdefault(row_key(name), []).extend((m.step, m.value) for m in c.get_metric_history(run.info.run_id, name))
        metrics = {k: sorted(v) for k, v in metrics.items()}
        out[run.info.run_name] = {"tags": dict(run.data.tags), "params": dict(run.data.params), "metrics": metrics}
    return out


def ui_links(uri: str, mlflow_url: str, prefect_url: str) -> list[tuple[str, str]]:
    """Direct links into both UIs: the Prefect flow runs, each experiment's runs table and charts in
    monim's saved view and its comparison's report run (the side-by-side table), and each registered
    model's versions."""
    c = client(uri)
    out = [("Prefect flow runs", f"{prefect_url}/runs")]
    for e in c.search_experiments():
        if e.name != "Default":
            view = f"{mlflow_url}/#/experiments/{e.experiment_id}/runs?viewStateShareKey={VIEW}&workflowType=machine_learning"
            out += [(f"MLflow runs of {e.name}", view), (f"MLflow charts of {e.name}", view + "&compareRunsMode=CHART")]
            report = c.search_runs([e.experiment_id], filter_string="tags.`monim.kind` = 'comparison'", max_results=1)
            out += [(f"MLflow report run of {e.name}", f"{mlflow_url}/#/experiments/{e.experiment_id}/runs/"
                     f"{report[0].info.run_id}")] if report else []
    out += [(f"model versions of {m.name}", f"{mlflow_url}/#/models/{m.name}") for m in c.search_registered_models()]
    return out
