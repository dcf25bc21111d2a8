"""How a command fails: one line on stderr naming what is wrong, and its exit status."""

from __future__ import annotations

import datetime as dt
from contextlib import contextmanager
from typing import Iterator, Optional, overload

import typer

NO_ROOM = 74  # the exit status of a command that ran out of room: a full disk or a file-size limit (sysexits' EX_IOERR)


def fail(message: str) -> typer.Exit:
    """Say what is wrong in one line on stderr; exit status 2."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


@overload
def option_date(value: str) -> dt.date: ...
@overload
def option_date(value: None) -> None: ...
def option_date(value: Optional[str]) -> Optional[dt.date]:
    """A date given on the command line (YYYY-MM-DD), or a clear error."""
    if value is None:
        return None
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise fail(f"not a date (YYYY-MM-DD): {value!r}")


@contextmanager
def clear_errors(*kinds: type[Exception]) -> Iterator[None]:
    """These errors (and a run held by another process, with --no-wait) end the command with their
    message, not a traceback."""
    from monim.core.lock import Locked

    caught: tuple[type[Exception], ...] = (Locked, *kinds)
    try:
        yield
    except caught as e:
        raise fail(str(e))
