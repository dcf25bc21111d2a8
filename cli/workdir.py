"""The work directory a command uses: Prefect's local state and API kept in it, Prefect's console made quiet,
and its MLflow store checked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from cli.errors import clear_errors, fail
from cli.output import console
from servers import local


def use_workdir(workdir: Path, api: bool = True, prefect: bool = True) -> None:
    """Point Prefect's local state at the work directory (unless a server or home is configured) and,
    for a command that runs flows, start its Prefect API; SIGTERM stops the command like Ctrl-C.
    `prefect`: False for a command that never imports Prefect (its console and SIGTERM handler left alone)."""
    prefect_home(workdir)
    local.interruptible()
    private = "PREFECT_API_URL" not in os.environ and api
    if "PREFECT_API_URL" not in os.environ:
        if api:
            os.environ["PREFECT_API_URL"] = local.prefect_api()
            console.print(f"Prefect: this command's flow runs are kept in {os.environ['PREFECT_HOME']} "
                          f"(`monim ui --workdir {workdir}` shows them)", highlight=False, soft_wrap=True)
    if prefect:
        local.guard_prefect_stops()
        quiet_console(tracebacks=not os.environ.get("MONIM_VERBOSE"), links=private)


def prefect_home(workdir: Path) -> None:
    """Make the work directory, and keep Prefect's local state in it unless a server is configured
    (before Prefect is imported: it reads its settings once)."""
    if workdir.exists() and not workdir.is_dir():
        raise fail(f"{workdir} is a file, not a work directory: give another --workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    if "PREFECT_API_URL" not in os.environ:
        os.environ.setdefault("PREFECT_HOME", str((workdir / "prefect").resolve()))


def quiet_console(tracebacks: bool, links: bool) -> None:
    """Prefect's lines on the terminal without their traceback (its UI keeps both; --verbose shows
    them here too), so a failure reads as one line; and, with `links`, without the "View at" links
    into this command's private API, which is gone when the command ends."""
    import logging

    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()  # its handlers, made now (else at the first flow run), to filter
    if tracebacks and _drop_traceback not in (store := logging.getLogger("mlflow.store.db.utils")).filters:
        store.addFilter(_drop_traceback)  # MLflow's store logs each database error (a full disk) with its traceback
    wanted = [f for f, on in ((_drop_traceback, tracebacks), (_drop_link, links)) if on]
    for logger in [logging.getLogger(), *map(logging.getLogger, list(logging.root.manager.loggerDict))]:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler):
                for f in wanted:
                    if f not in handler.filters:
                        handler.addFilter(f)


def _drop_traceback(record) -> bool:
    record.exc_info = record.exc_text = None
    return True


def _drop_link(record) -> bool:
    return not str(record.msg).startswith("View at ")


def use_tracking(workdir: Path, uri: Optional[str]) -> str:
    """The MLflow store's URI, the store checked (a damaged one is a clear error, before any work)."""
    from tracking.store import ensure_store, tracking_uri

    resolved = tracking_uri(str(workdir), uri)
    with clear_errors(ValueError):
        ensure_store(resolved)
    return resolved
