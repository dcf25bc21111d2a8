"""The `monim` command line: learn a news stream day by day, compare policies, evaluate, inspect.

Each command parses its options, calls one flow or one library function, and prints; the library
and Prefect are imported only by the command that runs, so that `--help` is instant.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import typer

from cli import bench, learning, reading, upkeep
from cli.errors import NO_ROOM
from monim.core.atomic import DiskFull, no_room
from monim.core.environment import set_defaults

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0],
                  rich_markup_mode=None)


def _version(value: bool) -> None:
    if value:
        from monim import __version__

        typer.echo(f"monim {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                                help="Print monim's version and exit."),
         verbose: bool = typer.Option(False, "--verbose", help="Show the libraries' warnings and, on a failure, the "
                                      "whole traceback (by default one line says what failed)."),
         ) -> None:
    """monim: keep a language model up to date with a daily news stream (MoNIM)."""
    set_defaults()
    if verbose:
        os.environ["MONIM_VERBOSE"] = "1"
    else:
        warnings.filterwarnings("ignore")


def guarded(command):
    """A command whose failure is one line on stderr (exit status 1; a full disk or a file-size limit,
    naming the file being written: NO_ROOM), the traceback only with --verbose."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001
            if os.environ.get("MONIM_VERBOSE"):
                raise
            if (room := no_room(e)) is not None:
                said = e if isinstance(e, DiskFull) else f"{room[0]} while writing {room[1] or 'a file'}"
                typer.echo(f"error: {said}", err=True)
                raise typer.Exit(NO_ROOM)
            typer.echo(f"error: {str(e).strip() or type(e).__name__} ({type(e).__name__}; --verbose shows where)",
                       err=True)
            raise typer.Exit(1)

    return wrapper


for command in (learning.run, learning.demo_feed, learning.learn, learning.compare, reading.evaluate, reading.generate, reading.status,
                reading.report, reading.serve_model, upkeep.fsck, upkeep.forget, upkeep.gc, learning.serve, upkeep.ui,
                upkeep.register, upkeep.promote, upkeep.rollback):
    app.command("eval" if command is reading.evaluate else None)(guarded(command))
# A bench's options are its own (argparse's): everything after NAME, --help too, goes to it untouched.
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                              "allow_interspersed_args": False})(guarded(bench.bench))
