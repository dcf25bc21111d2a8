"""The `monim` command line: learn a news stream day by day, compare policies, evaluate, inspect.

Each command parses its options, calls one flow or one library function, and prints; the library
and Prefect are imported only by the command that runs, so that `--help` is instant.
"""

from __future__ import annotations

from typing import Optional

import typer

from flows.cli import learning, reading, upkeep

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0],
                  rich_markup_mode=None)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"monim {version('monim')}")
        raise typer.Exit()


@app.callback()
def main(version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                                help="Print monim's version and exit.")) -> None:
    """monim: keep a language model up to date with a daily news stream (MoNIM)."""


for command in (learning.run, learning.learn, learning.compare, reading.evaluate, reading.generate, reading.status,
                reading.report, reading.serve_model, upkeep.fsck, upkeep.forget, upkeep.gc, learning.serve, upkeep.ui,
                upkeep.promote, upkeep.rollback):
    app.command("eval" if command is reading.evaluate else None)(command)
