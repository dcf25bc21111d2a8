"""MLflow tracking: an experiment per stream, a run per policy, metrics per day (step = day index)."""

from __future__ import annotations

import csv
import datetime as dt
import functools
import inspect
import os
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from prefect import task
from prefect.cache_policies import NO_CACHE

from monim import workdirs
from monim.atomic import create_once, sqlite_damage
from monim.catalogue import LEARNER, MEMORY
from monim.config import DEFAULT_MODEL, LEARNER_FIELDS, RunConfig
from monim.lock import hold
from monim.policies import policy_params, run_policy
from monim.stream import list_dates
from tasks.charts import NOT_LOGGED, VIEW, VIEW_TAG, chart_name, row_key, saved_view
from tasks.logs import logger


KIND = "mlflow.experimentKind"
COMPARISON = "monim.comparison"
MARK = "docs_train"  # logged every day, and never NaN: the metric that says a day is logged


def tracking_uri(workdir: str, uri: str | None = None) -> str:
    """The option, else $MLFLOW_TRACKING_URI, else a SQLite database inside the work directory."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


def experiment_name(source: str) -> str:
    """The default MLflow experiment of a stream: one per source."""
    return "monim-" + Path(source.removeprefix("hf:")).name.split(".")[0]


def one_at_a_time(fn):
    """Run a tracking call holding the lock of a local SQLite store: two processes must not use it at
    once (its first use creates and migrates the schema; concurrent writers then collide)."""

    @functools.wraps(fn)
    def locked(*args, **kwargs):
        db = sqlite_file(inspect.signature(fn).bind(*args, **kwargs).arguments["uri"])
        with hold(db.with_suffix(".lock"), say=logger().info) if db else nullcontext():
            return fn(*args, **kwargs)

    return locked


def sqlite_file(uri: str) -> Path | None:
    """The database file of a local SQLite store's URI; None for any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def ensure_store(uri: str) -> None:
    """Create a local SQLite store with its whole schema, if it does not exist yet. MLflow migrates a
    new file in dozens of steps, and one killed between them leaves a file no later run can open."""
    if (db := sqlite_file(uri)) is None:
        return
    if db.exists() and (damage := sqlite_damage(db)):
        raise ValueError(f"{db}: the MLflow store is damaged ({damage}); move it aside (mv {db} {db}.damaged): "
                         "`monim fsck --repair` logs the days again from the memories")
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    artifacts = (db.parent / "mlartifacts").as_uri()
    create_once(db, lambda tmp: SqlAlchemyStore(f"sqlite:///{tmp}", artifacts).engine.dispose())


def client(uri: str):
    """An MlflowClient (a local SQLite store is created whole first)."""
    from mlflow.tracking import MlflowClient

    ensure_store(uri)
    return MlflowClient(tracking_uri=uri)


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


def step_of(origin: str, date: str) -> int:
    """A day's MLflow step: days since the run's origin (its `monim.origin` tag)."""
    return (dt.date.fromisoformat(date) - dt.date.fromisoformat(origin)).days


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
def run_params(cfg: RunConfig) -> dict:
    """The run's settings as MLflow's flat parameters: the policy's as it learns with them, the
    learner's or the calibrator's as dotted names."""
    out = cfg.model_dump(exclude={"delta", "rate", "merge_k", "followed_memrate", "calibrator", "cluster", *LEARNER_FIELDS})
    if cfg.kind == LEARNER:
        out |= {f"learner.{k}": v for k, v in asdict(cfg.learner()).items()}
    elif cfg.kind == MEMORY:
        out |= {f"policy.{k}": v for k, v in policy_params(run_policy(cfg)).items()}
        out |= {f"calibrator.{k}": v for k, v in asdict(cfg.calibrator).items()}
    return out


@one_at_a_time
def open_run(cfg: RunConfig, experiment: str, uri: str, comparison: str | None = None) -> tuple[str, str]:
    """The MLflow run of this policy on this work directory, resumed (RUNNING again) if it exists,
    else created; tagged with `comparison`, the run that groups a comparison, if given (a tag: MLflow's
    parent link would fold the policies' rows away in the runs table); and its origin, the date of step 0:
    the stream's first day, tagged once when the run is created (so that a step always names the
    same date, and readers can turn steps back into dates)."""
    c = client(uri)
    memory = str(workdirs.memory_root(cfg.workdir, cfg.name).resolve())
    every = [e.experiment_id for e in c.search_experiments()]  # a renamed source keeps its run and experiment
    runs = c.search_runs(every, filter_string=f"tags.`monim.memory` = '{memory}'", max_results=1) if every else []
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
    _log(c, run_id, [(k, step, v) for k, v in row.items() if k not in NOT_LOGGED])
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
    return _log(c, run_id, [(k, step, v) for k, step, v in points if step not in have[k]])


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def metric_steps(run_id: str, uri: str, keys: list[str]) -> dict[str, list[int]]:
    """The steps at which each of these metrics is logged in the run."""
    c = client(uri)
    return {k: sorted(set(logged_steps(c, run_id, k))) for k in keys}


def logged_steps(c, run_id: str, key: str) -> list[int]:
    """The steps a row's metric is logged at, under its section or under its plain name (as runs
    made before sections logged it: old runs stay as they are, charted in MLflow's last section)."""
    return [m.step for name in (chart_name(key), key) for m in c.get_metric_history(run_id, name)]


def _log(c, run_id: str, points: list[tuple[str, int, object]]) -> int:
    """Log the numeric (finite or infinite, not NaN) points (row key, step, value) in batches, each
    under its chart name, at its step and with its day (the run's origin + step) as its time, so
    MLflow's time axis shows the stream's dates."""
    from mlflow.entities import Metric

    origin = c.get_run(run_id).data.tags.get("monim.origin")
    start = dt.datetime.fromisoformat(origin).replace(tzinfo=dt.timezone.utc).timestamp() if origin else None
    day_ms = lambda step: int(((start + 86400 * step) if start is not None else time.time()) * 1000)  # noqa: E731
    batch = [Metric(chart_name(k), float(v), day_ms(step), step) for k, step, v in points
             if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v]
    for i in range(0, len(batch), 1000):  # MLflow's limit per batch
        c.log_batch(run_id, metrics=batch[i : i + 1000])
    return len(batch)


@one_at_a_time
def check_steps(uri: str, workdir: str, repair: bool = False) -> list[dict]:
    """Each run's evaluated days against its MLflow runs: a day must be logged once (with `repair`,
    the metrics of a day not logged, or logged in part, are logged from the memory's manifest or the
    bare LM's record, never twice). A run that names the work directory's memory at another path
    (the work directory moved or was copied) is a warning; `repair` points it here. A run MLflow does
    not know, or no local store at all (memories copied without it), is a warning: nothing is lost."""
    if (db := sqlite_file(uri)) is not None and not db.exists():
        return [{"where": f"MLflow at {uri}", "what": "no MLflow store: the runs' days are not logged here",
                 "repair": None, "repaired": False, "warning": True}] if workdirs.run_names(workdir) else []
    c = client(uri)
    experiments = [e.experiment_id for e in c.search_experiments()]
    problems = []
    for name in workdirs.run_names(workdir):
        rows = workdirs.read_rows(workdir, name)
        memory = str(workdirs.memory_root(workdir, name).resolve())
        runs = c.search_runs(experiments, filter_string=f"tags.`monim.memory` = '{memory}'") if experiments else []
        if not runs and rows:
            moved = [r for r in (c.search_runs(experiments, filter_string=f"attributes.run_name = '{name}'")
                                 if experiments else []) if r.data.tags.get("monim.memory")]
            if not moved:
                problems.append({"where": f"MLflow at {uri}", "what": f"no run of {name}: {len(rows)} days not logged",
                                 "repair": None, "repaired": False, "warning": True})
                continue
            run = moved[0]
            problems.append({"where": f"MLflow run {name} ({run.info.run_id})", "warning": True, "repaired": repair,
                             "what": f"names the memory at {run.data.tags['monim.memory']}: the work directory moved "
                                     "or was copied (its registered versions keep naming the old place)",
                             "repair": "point the run at this work directory"})
            if repair:
                c.set_tag(run.info.run_id, "monim.memory", memory)
            runs = [run]
        for run in runs:
            history = logged_steps(c, run.info.run_id, MARK)
            logged = set(history)
            where = f"MLflow run {run.info.run_name} ({run.info.run_id})"
            missing = [r for r in rows.values() if r["step"] not in logged]
            if missing:
                problems.append({"where": where, "what": f"days {', '.join(r['date'] for r in missing)} not logged",
                                 "repair": "log them from the run's rows", "repaired": repair})
                if repair:
                    log_points.fn(run.info.run_id, uri, [(k, r["step"], v) for r in missing for k, v in r.items()
                                                         if k not in NOT_LOGGED])
            if twice := sorted({s for s in history if history.count(s) > 1}):
                problems.append({"where": where, "what": f"steps {twice} logged more than once", "repaired": False,
                                 "repair": None})
    return problems


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
        from monim.plots import memory_growth, ppl_over_days  # matplotlib: only where a run's charts are drawn

        for name, figure in (("memory_growth.png", memory_growth(rows)), ("ppl.png", ppl_over_days(rows))):
            figure.savefig(Path(tmp) / name, dpi=100, bbox_inches="tight")
            c.log_artifact(run_id, str(Path(tmp) / name), artifact_path="plots")


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
    monim's saved view, and each registered model's versions."""
    c = client(uri)
    out = [("Prefect flow runs", f"{prefect_url}/runs")]
    for e in c.search_experiments():
        if e.name != "Default":
            view = f"{mlflow_url}/#/experiments/{e.experiment_id}/runs?viewStateShareKey={VIEW}&workflowType=machine_learning"
            out += [(f"MLflow runs of {e.name}", view), (f"MLflow charts of {e.name}", view + "&compareRunsMode=CHART")]
    out += [(f"model versions of {m.name}", f"{mlflow_url}/#/models/{m.name}") for m in c.search_registered_models()]
    return out
