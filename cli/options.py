"""The commands' options: those several commands share, and the learning commands' made from RunConfig's
fields (monim.core.config): a setting has one name
in Python, in a deployment's `run` parameter and on the command line (`merge_k` is `--merge-k`), its
field's description as help and its field's default (what `--help` shows and a run gets)."""

from __future__ import annotations

import inspect
import types
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import typer

from monim.core.config import CALIBRATION_EXAMPLES, CalibratorConfig
from monim.core.run_config import RunConfig

SKIP_HELP = "Skip retrieval where the calibrator, after a cheap top-16 search, predicts λ below this number in [0, 1] (paper: 0.3)."

# options several commands share
DATE = "a date, YYYY-MM-DD"
WORKDIR = typer.Option(Path("monim-work"), "--workdir", help="Where memories, runs and records live (a folder).")
AS_JSON = typer.Option(False, "--json", help="Print one JSON object as the last line.")
MODEL = typer.Option(None, "--model", help="LM: alias, .gguf file, local dir or hub name (default SmolLM2-135M).")
TRACKING = typer.Option(None, "--tracking-uri", help="MLflow tracking URI (default: SQLite in the work directory).")
CONSTANT_LAM = typer.Option(False, "--constant-lam", help="Θ uses the constant λ, T instead of the NN calibrator.")
SKIP = typer.Option(None, "--skip", help=SKIP_HELP)
HALF_LIFE = typer.Option(None, "--half-life", help="Recency: a neighbour's kNN weight halves with every this many days "
                         "of age (nothing is deleted).")
MAX_AGE = typer.Option(None, "--max-age", help="Recency: leave entries older than this many days out of the search.")
POLICY = typer.Option(None, "--policy", help="Which memory (default: the only one, else monim-amt).")
AS_OF = typer.Option(None, "--as-of", metavar="YYYY-MM-DD", help=f"Read the memory as it stood after this day ({DATE}).")
START = typer.Option(None, "--start", metavar="YYYY-MM-DD", help=f"The first day to learn ({DATE}; default: the source's first).")
END = typer.Option(None, "--end", metavar="YYYY-MM-DD", help=f"The last day to learn ({DATE}; default: the source's last).")
WAIT = typer.Option(True, "--wait/--no-wait", help="While another process learns the same run in this work directory: "
                    "wait for it, saying who it is (default), or fail at once.")

# fields a command sets itself (source, workdir, policy) or a comparison does (followed_memrate); the
# calibrator's settings are one field, two of them with options of their own (CALIBRATOR)
NOT_OPTIONS = {"source", "workdir", "policy", "followed_memrate", "calibrator"}
NAMES = {"calibrated": ("--calibrated/--constant-lam",), "review": ("--review", "--review-text")}  # older names kept
FEED = ("date_field", "text_field", "id_field", "title_field", "missing_id")  # how a feed's records are read (Fields)
CALIBRATOR = {  # option -> (CalibratorConfig field, its type, help)
    "calibration": ("source", Optional[Literal[CALIBRATION_EXAMPLES]],
                    "Calibration examples: train (a sample of the day's training articles, their own near-duplicates "
                    "left out), yesterday (the sample against the memory before the day) or validation (the paper's: "
                    "the validation articles)."),
    "skip": ("skip_threshold", Optional[float], SKIP_HELP),
}


def _optional(annotation) -> tuple[Any, int | str | None]:
    """The field's type for the command line (None: the option not given), and the word for empty
    where the field may be empty: 0 for an `int | None` field, "none" for a `float | None` one (read
    as text, pydantic makes the number)."""
    args = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        empty: int | str | None = 0 if inner is int else "none" if inner is float else None
        return Optional[str if inner is float else inner], empty
    return Optional[annotation], None


def field_options() -> list[inspect.Parameter]:
    """One keyword parameter per RunConfig field a learning command takes, as Typer reads it."""
    out = []
    for name, f in RunConfig.model_fields.items():
        if name in NOT_OPTIONS:
            continue
        kind, empty = _optional(f.annotation)
        default = f.get_default(call_default_factory=True)
        help_text = (f.description or "") + (f" {empty} means empty." if empty is not None else "")
        flag = f"--{name.replace('_', '-')}"
        flags = NAMES.get(name, (f"{flag}/--no-{flag[2:]}",) if kind == Optional[bool] else (flag,))
        option = typer.Option(default, *flags, help=help_text, metavar="FLOAT|none" if empty == "none" else None)
        out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind))
    for name, (field, kind, help_text) in CALIBRATOR.items():
        option = typer.Option(getattr(CalibratorConfig(), field), f"--{name}", help=help_text)
        out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind))
    return out


def given_fields(options: dict) -> dict:
    """RunConfig's fields from the options (an option not given is its field's default, or None: the default kept)."""
    out = {}
    for name, f in RunConfig.model_fields.items():
        value = options.get(name)
        if value is not None and name not in NOT_OPTIONS:
            empty = _optional(f.annotation)[1]
            out[name] = None if empty is not None and value == empty else value
    calibrator = {field: options[name] for name, (field, _, _) in CALIBRATOR.items() if options.get(name) is not None}
    return out | ({"calibrator": calibrator} if calibrator else {})
