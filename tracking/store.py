"""MLflow's store: where it lies (and where the paths it recorded lie now, its work directory moved or
copied) and its client (one process at a time on a local SQLite file, created whole). No Prefect here:
read-only commands start at once."""

from __future__ import annotations

import functools
import inspect
import os
from contextlib import closing, nullcontext
from pathlib import Path
from typing import Callable, ContextManager, ParamSpec, TypeVar

from monim.core.atomic import create_once, sqlite_damage
from monim.core.lock import hold, reading
from tasks.logs import logger

P = ParamSpec("P")
R = TypeVar("R")


def tracking_uri(workdir: str, uri: str | None = None) -> str:
    """The option, else $MLFLOW_TRACKING_URI, else a SQLite database inside the work directory."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


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

    def make(tmp: Path) -> None:  # MLflow imported only to make a store: its import takes seconds
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        SqlAlchemyStore(f"sqlite:///{tmp}", (db.parent / "mlartifacts").as_uri()).engine.dispose()

    create_once(db, make)


def tracked(uri: str, tags: dict[str, str]) -> str | None:
    """The id of a run (not deleted) with these tags in a local SQLite store, read without MLflow (its import
    takes seconds); None where there is none, or for another store."""
    has = " and ".join(["exists (select 1 from tags t where t.run_uuid = r.run_uuid and t.key = ? and t.value = ?)"] * len(tags))
    found = _query(uri, f"select r.run_uuid from runs r where r.lifecycle_stage = 'active' and {has} limit 1",
                   [x for kv in tags.items() for x in kv])
    return found[0][0] if found else None


def latest_metrics(uri: str, run_id: str) -> dict[str, float]:
    """A run's metrics as they stand (each key's latest value) in a local SQLite store, read without MLflow."""
    return dict(_query(uri, "select key, value from latest_metrics where run_uuid = ?", [run_id]))


def _query(uri: str, sql: str, params: list) -> list[tuple]:
    """Rows of a read-only query of a local SQLite store (waiting while a writer holds it); none for another store."""
    import sqlite3

    if (db := sqlite_file(uri)) is None or not db.exists():
        return []
    with store_lock(uri, write=False), closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as store:
        return store.execute(sql, params).fetchall()


def client(uri: str):
    """An MlflowClient (a local SQLite store is created whole first)."""
    from mlflow.tracking import MlflowClient

    ensure_store(uri)
    return MlflowClient(tracking_uri=uri)


