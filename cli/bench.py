"""The bench command: list the benches, or run one with its own options."""

from __future__ import annotations

import importlib
from typing import Optional

import typer

from benchmarks.catalogue import BENCHES, description


def bench(ctx: typer.Context, name: Optional[str] = typer.Argument(None, help="The bench to run (--list names them); "
                                                                   "the options after it are its own (NAME --help)."),
          list_: bool = typer.Option(False, "--list", help="Each bench: its name, what it needs, its minutes on "
                                     "2 cores and what it measures.")) -> None:
    """Run a bench, which writes its result with an envelope (commit, machine, versions, options, start
    and end) to docs/results/NAME/; --list names the benches."""
    if list_ or name is None:
        width = max(map(len, BENCHES))
        for bench_name, b in BENCHES.items():
            needs = ", ".join(b.needs) or "-"
            typer.echo(f"{bench_name:<{width}}  {needs:<11}  {b.minutes:>5g} min  {description(bench_name)}")
        return
    if name not in BENCHES:
        typer.echo(f"error: no bench {name!r}; the benches: {', '.join(BENCHES)}", err=True)
        raise typer.Exit(2)
    importlib.import_module(f"benchmarks.{BENCHES[name].module}").main(list(ctx.args))
