"""What MLflow runs logged, read and written without Prefect (read-only commands start at once): the runs
that learn a memory, a day's step, a day's metrics logged once, and fsck's check of the days each run logged."""

from __future__ import annotations

import datetime as dt
import json
import math
import tempfile
import time
from pathlib import Path

from monim.core.numbers import rounded
from monim.storage import workdirs
from tracking.charts import NOT_LOGGED, chart_name
from tracking.store import client, sqlite_file, store_lock

MARK = "docs_train"  # logged every day, and never NaN: the metric that says a day is logged


def step_of(origin: str, date: str) -> int:
    """A day's MLflow step: days since the run's origin (its `monim.origin` tag)."""
    return (dt.date.fromisoformat(date) - dt.date.fromisoformat(origin)).days


def memory_runs(c, memory: str | Path, max_results: int = 1000) -> list:
    """The MLflow runs that learn the memory at this path (tag `monim.memory`)."""
    every = [e.experiment_id for e in c.search_experiments()]
    return c.search_runs(every, filter_string=f"tags.`monim.memory` = '{Path(memory).resolve()}'",
                         max_results=max_results) if every else []


def run_config(c, run_id: str) -> dict | None:
    """The settings a run learns with (its `config.json`, monim.core.run_config.RunConfig), or None where it has none."""
    from mlflow.exceptions import MlflowException

    try:
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(c.download_artifacts(run_id, "config.json", tmp)).read_text())
    except (OSError, ValueError, MlflowException):
        return None


def logged_steps(c, run_id: str, key: str) -> list[int]:
    """The steps a row's metric is logged at, under its section or under its plain name (as runs
    made before sections logged it: old runs stay as they are, charted in MLflow's last section)."""
    return [m.step for name in (chart_name(key), key) for m in c.get_metric_history(run_id, name)]


def log_metrics(c, run_id: str, points: list[tuple[str, int, object]]) -> int:
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


def check_steps(uri: str, workdir: str, repair: bool = False) -> list[dict]:
    """Each run's evaluated days against its MLflow runs: a day must be logged once (with `repair`,
    the metrics of a day not logged, or logged in part, are logged from the memory's manifest or the
    bare LM's record, never twice). A run that names the work directory's memory at another path
    (the work directory moved or was copied) is a warning; `repair` points it here. A run MLflow does
    not know, or no local store at all (memories copied without it), is a warning: nothing is lost."""
    if (db := sqlite_file(uri)) is not None and not db.exists():
        return [{"where": f"MLflow at {uri}", "what": "no MLflow store: the runs' days are not logged here",
                 "repair": None, "repaired": False, "warning": True}] if workdirs.run_names(workdir) else []
    with store_lock(uri, repair):  # a check only reads
        return _check_steps(uri, workdir, repair)


def _check_steps(uri: str, workdir: str, repair: bool) -> list[dict]:
    c = client(uri)
    experiments = [e.experiment_id for e in c.search_experiments()]
    problems = []
    for name in workdirs.run_names(workdir):
        rows = workdirs.read_rows(workdir, name)
        memory = str(workdirs.memory_root(workdir, name).resolve())
        runs = memory_runs(c, memory)
        if not runs and rows:
            elsewhere = [r for r in (c.search_runs(experiments, filter_string=f"attributes.run_name = '{name}'")
                                 if experiments else []) if r.data.tags.get("monim.memory")]
            if not elsewhere:
                problems.append({"where": f"MLflow at {uri}", "what": f"no run of {name}: {len(rows)} days not logged",
                                 "repair": None, "repaired": False, "warning": True})
                continue
            run = elsewhere[0]
            problems.append({"where": f"MLflow run {name} ({run.info.run_id})", "warning": True, "repaired": repair,
                             "what": f"names the memory at {run.data.tags['monim.memory']}: the work directory moved "
                                     "or was copied (its registered versions name the old place too, and read this "
                                     "work directory's memory)",
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
                    log_metrics(c, run.info.run_id, [(k, r["step"], v) for r in missing for k, v in r.items()
                                                     if k not in NOT_LOGGED])
            if twice := sorted({s for s in history if history.count(s) > 1}):
                problems.append({"where": where, "what": f"steps {twice} logged more than once", "repaired": False,
                                 "repair": None})
    return problems


def side_by_side(summary: dict[str, dict]) -> dict[str, float]:
    """A comparison's metrics: each policy's totals (monim.evaluation.totals.summarize) as `<policy>/<total>` at
    the terminal's digits, which MLflow's run page groups by policy ('+' reads ' with ': no metric name takes it)."""
    return {f"{p.replace('+', ' with ')}/{k}": rounded(float(v)) for p, totals in summary.items() for k, v in totals.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
