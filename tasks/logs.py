"""The logger a task writes to: Prefect's run logger inside a run, a plain one outside."""

from __future__ import annotations

import logging


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a run, a plain logger outside (e.g. unit tests via .fn)."""
    # imported here: the MLflow store's lock logs through this, and read-only commands import no Prefect
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("monim")
