"""A learn that runs out of room (a full disk, a file-size limit): one line saying what happened, the file being
written, and what the memory holds now."""

from __future__ import annotations

import datetime as dt
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import typer

from cli.errors import NO_ROOM, option_date
from servers import local

if TYPE_CHECKING:
    from monim.core.run_config import RunConfig


@contextmanager
def said_when_full(cfg: RunConfig, start: Optional[str], end: Optional[str], relearn: list[str], uri: str) -> Iterator[None]:
    """A learn that runs out of room (a full disk, a file-size limit) ends with one line: what happened,
    the file being written, and what the memory holds now; exit status NO_ROOM."""
    from monim.storage.workdirs import memory_root

    root = memory_root(cfg.workdir, cfg.name)
    before = _days(root)
    try:
        yield
    except Exception as e:  # noqa: BLE001 (only a full disk or file-size limit is said here; the rest goes on)
        if os.environ.get("MONIM_VERBOSE") or (what := room(e, cfg.workdir, uri)) is None:
            raise
        typer.echo(f"error: {what}: {memory_now(cfg, start, end, relearn, uri, before)}", err=True)
        raise typer.Exit(NO_ROOM)


def room(error: Exception, workdir: str, uri: str) -> str | None:
    """What a failure says of room, in words (what happened, the file being written): the error's own
    (monim.core.atomic.no_room), else the database that cannot grow of the SQLite store that failed
    (MLflow's names no file, and this command's Prefect API answers 500 or does not start); None
    where room is not the cause."""
    from monim.core.atomic import SQLITE_FULL, no_room, out_of_room
    from tracking.store import sqlite_file

    mlflow = sqlite_file(uri)
    if (found := no_room(error)) is not None:
        what, path = found
        return f"{what} while writing {path or (mlflow if what == SQLITE_FULL and mlflow else f'in {workdir}')}"
    said = str(error)
    if "Prefect's API did not start" in said or ("Server error '5" in said and local.private_api()):
        return out_of_room(Path(os.environ["PREFECT_HOME"]) / "prefect.db")
    return out_of_room(mlflow) if mlflow and "sqlite3.OperationalError" in said else None


def _days(root: Path) -> list[str]:
    from monim.storage.datastore import Datastore

    return [d.date for d in Datastore.read(root).days] if (root / "manifest.json").exists() else []


def memory_now(cfg: RunConfig, start: Optional[str], end: Optional[str], relearn: list[str], uri: str,
               before: list[str]) -> str:
    """What a learn that stopped left: the memory unchanged since `before` (the days it held), or the day
    it stopped at committed and what that day lacks (the recipe's later stages: `monim fsck --repair`)."""
    from monim.plan import plan
    from monim.storage.datastore import Datastore
    from monim.storage.fsck import unfinished
    from monim.storage.workdirs import memory_root
    from tracking.versions import untracked

    root = memory_root(cfg.workdir, cfg.name)
    try:
        todo = [d.isoformat() for d in plan(cfg, option_date(start), option_date(end), [dt.date.fromisoformat(d) for d in relearn]).todo]
        now = _days(root)
        missing = unfinished(Datastore.read(root)).get(todo[0]) if todo and todo[0] in now else None
        if missing is not None:
            missing += untracked(uri, root, todo[0])
    except Exception:  # noqa: BLE001 (what cannot be read now: fsck says it)
        return f"`monim fsck --workdir {cfg.workdir}` says what the memory holds"
    if not todo:
        return "every day of the range is learned and recorded"
    if missing is None:
        kept = [d for d in now if d not in before]
        return (f"the memory is unchanged (day {todo[0]} not committed)" if not kept else
                f"days {kept[0]} to {kept[-1]} are learned; the memory is otherwise unchanged (day {todo[0]} not committed)")
    return (f"day {todo[0]} is committed; it is {', '.join('not ' + m for m in missing)}: `monim fsck --workdir "
            f"{cfg.workdir} --repair` (or this learn again) finishes it once there is room")
