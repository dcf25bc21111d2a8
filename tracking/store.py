"""MLflow's store: where it lies (and where the paths it recorded lie now, its work directory moved or
copied), its client (one process at a time on a local SQLite file, created whole), and fsck's check of
the days each run logged. No Prefect here: read-only commands start at once."""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import json
import os
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, ContextManager, ParamSpec, TypeVar

from monim.core.atomic import create_once, sqlite_damage
from monim.core.lock import hold, reading
from monim.storage import workdirs
from tasks.logs import logger
from tracking.charts import NOT_LOGGED, chart_name

MARK = "docs_train"  # logged every day, and never NaN: the metric that says a day is logged
P = ParamSpec("P")
R = TypeVar("R")


def tracking_uri(workdir: str, uri: str | None = None) -> str:
    """The option, else $MLFLOW_TRACKING_URI, else a SQLite database inside the work directory."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


def experiment_name(source: str) -> str:
    """The default MLflow experiment of a stream: one per source."""
    return "monim-" + Path(source.removeprefix("hf:")).name.split(".")[0]


def store_lock(uri: str, write: bool = True) -> ContextManager:
    """The lock of a local SQLite store (none for another store): a writer holds it; a reader
    (`write` False) waits while a writer holds it, writing nothing (fsck runs on a full disk)."""
    if (db := sqlite_file(uri)) is None:
        return nullcontext()
    return (hold if write else reading)(db.with_suffix(".lock"), say=lambda *a: logger().info(*a))


def one_at_a_time(fn: Callable[P, R], write: bool = True) -> Callable[P, R]:
    """Run a tracking call holding the lock of a local SQLite store: two processes must not use it at
    once (its first use creates and migrates the schema; concurrent writers then collide). `write`
    False: a call that only reads (store_lock)."""

    @functools.wraps(fn)
    def locked(*args: P.args, **kwargs: P.kwargs) -> R:
        with store_lock(inspect.signature(fn).bind(*args, **kwargs).arguments["uri"], write):
            return fn(*args, **kwargs)

    return locked


def read_only(fn: Callable[P, R]) -> Callable[P, R]:
    """A tracking call that only reads: it waits for a writer and writes nothing (one_at_a_time)."""
    return one_at_a_time(fn, write=False)


def step_of(origin: str, date: str) -> int:
    """A day's MLflow step: days since the run's origin (its `monim.origin` tag)."""
    return (dt.date.fromisoformat(date) - dt.date.fromisoformat(origin)).days


def sqlite_file(uri: str) -> Path | None:
    """The database file of a local SQLite store's URI; None for any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def moved(uri: str, memory: str) -> tuple[Path, Path] | None:
    """(where the work directory was, where it is) when a version's memory (`<workdir>/memories/<name>`)
    was recorded in a local store that has been moved or copied since (the store lies in its work
    directory, beside that memory); None where it has not."""
    db, recorded = sqlite_file(uri), Path(memory)
    if db is None or recorded.parent.name != "memories" or recorded.parents[1] == (now := db.resolve().parent):
        return None
    return (recorded.parents[1], now) if (now / "memories" / recorded.name / "manifest.json").exists() else None


def here(uri: str, memory: str, recorded: str) -> str:
    """Where a path or file URI that a version recorded inside its work directory (`memory`: the version's
    memory) lies now: in this store's work directory where that moved or was copied since (a restored
    backup's version reads the backup's files, never the original's)."""
    if (found := moved(uri, memory)) is None:
        return recorded
    old, now = found
    if recorded.startswith("file://"):
        return recorded.replace(old.as_uri(), now.as_uri(), 1)
    return str(now / Path(recorded).relative_to(old))


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


def memory_runs(c, memory: str | Path, max_results: int = 1000) -> list:
    """The MLflow runs that learn the memory at this path (tag `monim.memory`)."""
    every = [e.experiment_id for e in c.search_experiments()]
    return c.search_runs(every, filter_string=f"tags.`monim.memory` = '{Path(memory).resolve()}'",
                         max_results=max_results) if every else []


def run_config(c, run_id: str) -> dict | None:
    """The settings a run learns with (its `config.json`, monim.core.config.RunConfig), or None where it has none."""
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
