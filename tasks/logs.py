"""The logger a task writes to: Prefect's run logger inside a run, a plain one outside."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.exceptions import MissingContextError


def logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a run, a plain logger outside (e.g. unit tests via .fn)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("monim")
