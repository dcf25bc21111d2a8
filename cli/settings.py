"""The run's settings (RunConfig) built from a command's options (one builder), and the evaluation suite's."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from cli.errors import clear_errors, fail
from cli.options import AS_JSON, END, FEED, HALF_LIFE, MAX_AGE, START, TRACKING, WAIT, WORKDIR, field_options

if TYPE_CHECKING:  # the CLI imports the library lazily, so that --help is instant
    from monim.core.config import EvalConfig
    from monim.core.run_config import RunConfig


def evaluation(period: Optional[str] = None, period_docs: Optional[int] = None, text: Optional[Path] = None,
               text_chars: Optional[int] = None, text_every: int = 7, qa: Optional[Path] = None, shots: str = "0",
               half_life: Optional[float] = None, max_age: Optional[int] = None) -> EvalConfig:
    """The evaluation suite's settings (monim.evaluation.suite.EvalConfig), or a clear error."""
    from monim.core.config import EvalConfig

    for path in (text, qa):
        if path is not None and not path.is_file():
            raise fail(f"file not found: {path}")
    with clear_errors(ValueError):
        return EvalConfig(period, period_docs, str(text) if text else None, text_chars, text_every,
                          str(qa) if qa else None, tuple(int(k) for k in shots.split(",")), half_life=half_life,
                          max_age=max_age)


def _shared_options(source: str = typer.Option(..., "--source", help="The news stream: a JSON Lines file (an article a "
                                              "line: id, date, text, title), a News Crawl file, a folder of per-day "
                                              "files, or hf:NAME (a `datasets` dataset)."),
                  start: Optional[str] = START, end: Optional[str] = END, workdir: Path = WORKDIR,
                  period: Optional[str] = typer.Option(None, "--period", help="month or week: PPL on each period's test "
                                                       "set as of each period's end."),
                  period_docs: Optional[int] = typer.Option(None, "--period-docs", help="Test articles per period "
                                                            "(default: all)."),
                  text: Optional[Path] = typer.Option(None, "--text", help="Forgetting probe: a general-domain text "
                                                      "file (e.g. WikiText)."),
                  text_chars: Optional[int] = typer.Option(None, "--text-chars", help="Only the text's first characters."),
                  text_every: int = typer.Option(7, "--text-every", help="Days between forgetting probes."),
                  qa: Optional[Path] = typer.Option(None, "--qa", help="Multiple-choice questions (a JSONL file) for the "
                                                    "final memories."),
                  shots: str = typer.Option("0", "--shots", help="Comma-separated numbers of solved examples, e.g. 0,3."),
                  half_life: Optional[float] = HALF_LIFE, max_age: Optional[int] = MAX_AGE,
                  tracking_uri: Optional[str] = TRACKING, wait: bool = WAIT, as_json: bool = AS_JSON) -> None:
    """The options every learning command takes besides the run's settings (cli.options)."""


def learning_options(command):
    """Give a learning command the run's settings as options (one per RunConfig field, cli.options)
    and the evaluation suite's; it is called with them built: `cfg` (monim.core.run_config.RunConfig),
    `evaluation` (None: nothing to measure), and `source`, `start`, `end`, `workdir`, `tracking_uri`,
    `wait`, `as_json` as given."""
    own, shared, settings = inspect.signature(command), inspect.signature(_shared_options), field_options()
    passed = ("source", "start", "end", "workdir", "tracking_uri", "wait", "as_json")

    @functools.wraps(command)
    def wrapper(**values):
        options = {k: values.pop(k) for k in [*shared.parameters, *(p.name for p in settings)]}
        values |= {k: options[k] for k in passed}
        values["cfg"] = config_from_options(policy=values.pop("policy", "monim-amt"), **options)
        suite = evaluation(options["period"], options["period_docs"], options["text"], options["text_chars"],
                           options["text_every"], options["qa"], options["shots"], options["half_life"], options["max_age"])
        if not (suite.period or suite.text or suite.qa):
            if suite.recency.active:
                raise fail("--half-life and --max-age apply to the evaluation suite: give --period, --text or --qa too")
            suite = None
        return command(evaluation=suite, **values)

    mine = [p for name, p in own.parameters.items() if name not in ("cfg", "evaluation", *passed)]
    wrapper.__signature__ = own.replace(parameters=mine + list(shared.parameters.values()) + settings)
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}  # what Typer reads
    return wrapper


def feed_options(command):
    """Give a command that reads a feed besides learning it (eval, status) the options that name its records'
    fields, as `learn` takes them (cli.options.FEED); it is called with them as `fields`
    (monim.core.config.Fields)."""
    own = inspect.signature(command)

    @functools.wraps(command)
    def wrapper(**values):
        return command(fields=config_from_options(**{k: values.pop(k) for k in FEED}).fields(), **values)

    mine = [p for name, p in own.parameters.items() if name != "fields"]
    wrapper.__signature__ = own.replace(parameters=mine + [p for p in field_options() if p.name in FEED])
    wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}  # what Typer reads
    return wrapper


def config_from_options(policy: str = "monim-amt", source: str = "", workdir: Path = Path("monim-work"), **options) -> RunConfig:
    """The run's typed settings from the options (what is not given: RunConfig's defaults), or a clear
    error naming the field. Without --review, Mix-Review reviews the text the forgetting probe does not read."""
    from pydantic import ValidationError

    from cli.options import given_fields
    from monim.core.run_config import RunConfig

    given = given_fields(options)
    if "review" not in given and options.get("text") is not None and options.get("text_chars"):
        given |= {"review": str(options["text"]), "review_from": options["text_chars"]}
    try:
        return RunConfig(source=source, policy=policy, workdir=str(workdir), **given)
    except ValidationError as e:
        raise fail("; ".join(": ".join([*map(str, err["loc"]), err["msg"].removeprefix("Value error, ")])
                             for err in e.errors()))
