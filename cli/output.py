"""What a command prints: tables and notes on stderr, and with --json one JSON object as its last line."""

from __future__ import annotations

import json

from rich import box
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def emit(result: dict, as_json: bool) -> None:
    """With --json, the command's result as one JSON object on stdout."""
    if as_json:
        print(json.dumps(result, default=str))


def table(title: str, rows: list[dict], columns: list[str]) -> Table:
    """Rows as a table, each number as monim.core.numbers.shown writes it."""
    out = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))  # fits 80 columns
    for col in columns:
        out.add_column(col, justify="left" if col == columns[0] else "right")
    from monim.core.numbers import shown

    for r in rows:
        out.add_row(*[shown(r.get(c, ""), c) for c in columns])
    return out
