"""What the commands share: options, the run's spec built from them (one builder), errors and output."""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from cli.options import FEED, SKIP_HELP, field_options
from servers import local

if TYPE_CHECKING:  # the CLI imports the library lazily, so that --help is instant
    from monim.core.config import RunConfig
    from monim.evaluation.suite import EvalConfig
    from monim.theta.memory import Memory

console = Console(stderr=True)

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


NO_ROOM = 74  # the exit status of a command that ran out of room: a full disk or a file-size limit (sysexits' EX_IOERR)


def fail(message: str) -> typer.Exit:
    """Say what is wrong in one line on stderr; exit status 2."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=str))


def table(title: str, rows: list[dict], columns: list[str]) -> Table:
    out = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))  # fits 80 columns
    for col in columns:
        out.add_column(col, justify="left" if col == columns[0] else "right")
    from monim.core.numbers import shown

    for r in rows:
        out.add_row(*[shown(r.get(c, ""), c) for c in columns])
    return out


def day(value: Optional[str]) -> Optional[dt.date]:
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

    try:
        yield
    except (Locked, *kinds) as e:
        raise fail(str(e))


@contextmanager
def said_when_full(spec: RunConfig, start: Optional[str], end: Optional[str], relearn: list[str], uri: str) -> Iterator[None]:
    """A learn that runs out of room (a full disk, a file-size limit) ends with one line: what happened,
    the file being written, and what the memory holds now; exit status NO_ROOM."""
    from monim.storage.workdirs import memory_root

    root = memory_root(spec.workdir, spec.name)
    before = _days(root)
    try:
        yield
    except Exception as e:  # noqa: BLE001 (only a full disk or file-size limit is said here; the rest goes on)
        if os.environ.get("MONIM_VERBOSE") or (what := room(e, spec.workdir, uri)) is None:
            raise
        typer.echo(f"error: {what}: {memory_now(spec, start, end, relearn, uri, before)}", err=True)
        raise typer.Exit(NO_ROOM)


def room(error: Exception, workdir: str, uri: str) -> str | None:
    """What a failure says of room, in words (what happened, the file being written): the error's own
    (monim.core.atomic.no_room), else the database that cannot grow of the SQLite store that failed
    (MLflow's names no file, and this command's Prefect API answers 500 or does not start); None
    where room is not the cause."""
    from monim.core.atomic import SQLITE_FULL, no_room, out_of_room
    from tracking.store import sqlite_file

    mlflow = sqlite_file(uri)
    if (found := no_room(error)) is not None:
        what, path = found
        return f"{what} while writing {path or (mlflow if what == SQLITE_FULL and mlflow else f'in {workdir}')}"
    said = str(error)
    if "Prefect's API did not start" in said or ("Server error '5" in said and local.private_api()):
        return out_of_room(Path(os.environ["PREFECT_HOME"]) / "prefect.db")
    return out_of_room(mlflow) if mlflow and "sqlite3.OperationalError" in said else None


def _days(root: Path) -> list[str]:
    from monim.storage.datastore import Datastore

    return [d.date for d in Datastore.read(root).days] if (root / "manifest.json").exists() else []


def memory_now(spec: RunConfig, start: Optional[str], end: Optional[str], relearn: list[str], uri: str,
               before: list[str]) -> str:
    """What a learn that stopped left: the memory unchanged since `before` (the days it held), or the day
    it stopped at committed and what that day lacks (the recipe's later stages: `monim fsck --repair`)."""
    from monim.plan import plan
    from monim.storage.datastore import Datastore
    from monim.storage.fsck import unfinished
    from monim.storage.workdirs import memory_root
    from tracking.registry import untracked

    root = memory_root(spec.workdir, spec.name)
    try:
        todo = [d.isoformat() for d in plan(spec, day(start), day(end), [day(d) for d in relearn]).todo]
        now = _days(root)
        missing = unfinished(Datastore.read(root)).get(todo[0]) if todo and todo[0] in now else None
        if missing is not None:
            missing += untracked(uri, root, todo[0])
    except Exception:  # noqa: BLE001 (what cannot be read now: fsck says it)
        return f"`monim fsck --workdir {spec.workdir}` says what the memory holds"
    if not todo:
        return "every day of the range is learned and recorded"
    if missing is None:
        kept = [d for d in now if d not in before]
        return (f"the memory is unchanged (day {todo[0]} not committed)" if not kept else
                f"days {kept[0]} to {kept[-1]} are learned; the memory is otherwise unchanged (day {todo[0]} not committed)")
    return (f"day {todo[0]} is committed; it is {', '.join('not ' + m for m in missing)}: `monim fsck --workdir "
            f"{spec.workdir} --repair` (or this learn again) finishes it once there is room")


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


def date_range(start: Optional[str], end: Optional[str]) -> tuple[Optional[dt.date], Optional[dt.date]]:
    """--start and --end as dates, or a clear error (not a date; a reversed range)."""
    first, last = day(start), day(end)
    if first and last and first > last:
        raise fail(f"--start {start} is after --end {end}: the range holds no day")
    return first, last


@contextmanager
def refused_plans() -> Iterator[None]:
    """A flow's plan that refuses its range (monim.plan: a missing feed, an empty range, a day before a memory's
    last, a bad record naming its file, line and field, an id a memory read on another day), or a bad record
    met later, ends the command in one line."""
    from monim.data.sources import StreamError
    from monim.plan import RangeError

    with clear_errors(FileNotFoundError, StreamError, RangeError):
        yield


def memory_dir(workdir: Path, policy: Optional[str]) -> Path:
    """The memory a reading command reads: the one named, the only one, else MoNIM-AMT's."""
    from monim.storage.workdirs import memories

    found = memories(workdir)
    if not found:
        raise fail(f"no memory in {workdir} (run `monim learn` first)")
    if policy:
        match = [p for p in found if p.name == policy]
        if not match:
            raise fail(f"no {policy!r} memory in {workdir}; there are: {', '.join(p.name for p in found)}")
        return match[0]
    return found[0] if len(found) == 1 else next((p for p in found if p.name == "monim-amt"), found[0])


def open_memory(workdir: Path, policy: Optional[str], as_of: Optional[str], **overrides) -> Memory:
    """Θ as the chosen memory describes itself (monim.theta.memory.Memory.open), with a reader's overrides."""
    from monim.core.manifest import ManifestError, MemoryMismatch
    from monim.storage.memory_settings import SettingsMismatch
    from monim.theta.memory import Memory

    root = memory_dir(workdir, policy)
    with clear_errors(ManifestError, MemoryMismatch, SettingsMismatch, ValueError):
        memory = Memory.open(root, as_of=day(as_of), **{k: v for k, v in overrides.items() if v is not None})
    first = memory.ds.days[0].date if memory.ds.days else None
    if as_of is not None and (first is None or day(as_of).isoformat() < first):
        raise fail(f"--as-of {as_of}: {root} holds no day on or before it (its first day is {first or 'not learned yet'})")
    return memory


def evaluation(period: Optional[str] = None, period_docs: Optional[int] = None, text: Optional[Path] = None,
               text_chars: Optional[int] = None, text_every: int = 7, qa: Optional[Path] = None, shots: str = "0",
               half_life: Optional[float] = None, max_age: Optional[int] = None) -> EvalConfig:
    """The evaluation suite's settings (monim.evaluation.suite.EvalConfig), or a clear error."""
    from monim.evaluation.suite import EvalConfig

    for path in (text, qa):
        if path is not None and not path.is_file():
            raise fail(f"file not found: {path}")
    with clear_errors(ValueError):
        return EvalConfig(period, period_docs, str(text) if text else None, text_chars, text_every,
                          str(qa) if qa else None, tuple(int(k) for k in shots.split(",")), half_life=half_life,
                          max_age=max_age)


def _spec_options(source: str = typer.Option(..., "--source", help="The news stream: a JSON Lines file (an article a "
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
    and the evaluation suite's; it is called with them built: `spec` (monim.core.config.RunConfig),
    `evaluation` (None: nothing to measure), and `source`, `start`, `end`, `workdir`, `tracking_uri`,
    `wait`, `as_json` as given."""
    own, shared, settings = inspect.signature(command), inspect.signature(_spec_options), field_options()
    passed = ("source", "start", "end", "workdir", "tracking_uri", "wait", "as_json")

    @functools.wraps(command)
    def run(**values):
        options = {k: values.pop(k) for k in [*shared.parameters, *(p.name for p in settings)]}
        values |= {k: options[k] for k in passed}
        values["spec"] = run_spec(policy=values.pop("policy", "monim-amt"), **options)
        suite = evaluation(options["period"], options["period_docs"], options["text"], options["text_chars"],
                           options["text_every"], options["qa"], options["shots"], options["half_life"], options["max_age"])
        if not (suite.period or suite.text or suite.qa):
            if suite.recency.active:
                raise fail("--half-life and --max-age apply to the evaluation suite: give --period, --text or --qa too")
            suite = None
        return command(evaluation=suite, **values)

    mine = [p for name, p in own.parameters.items() if name not in ("spec", "evaluation", *passed)]
    run.__signature__ = own.replace(parameters=mine + list(shared.parameters.values()) + settings)
    run.__annotations__ = {p.name: p.annotation for p in run.__signature__.parameters.values()}  # what Typer reads
    return run


def feed_options(command):
    """Give a command that reads a feed besides learning it (eval, status) the options that name its records'
    fields, as `learn` takes them (cli.options.FEED); it is called with them as `fields`
    (monim.core.config.Fields)."""
    own = inspect.signature(command)

    @functools.wraps(command)
    def run(**values):
        return command(fields=run_spec(**{k: values.pop(k) for k in FEED}).fields(), **values)

    mine = [p for name, p in own.parameters.items() if name != "fields"]
    run.__signature__ = own.replace(parameters=mine + [p for p in field_options() if p.name in FEED])
    run.__annotations__ = {p.name: p.annotation for p in run.__signature__.parameters.values()}  # what Typer reads
    return run


def run_spec(policy: str = "monim-amt", source: str = "", workdir: Path = Path("monim-work"), **options) -> RunConfig:
    """The run's typed spec from the options (what is not given: RunConfig's defaults), or a clear
    error naming the field. Without --review, Mix-Review reviews the text the forgetting probe does not read."""
    from pydantic import ValidationError

    from cli.options import given_fields
    from monim.core.config import RunConfig

    given = given_fields(options)
    if "review" not in given and options.get("text") is not None and options.get("text_chars"):
        given |= {"review": str(options["text"]), "review_from": options["text_chars"]}
    try:
        return RunConfig(source=source, policy=policy, workdir=str(workdir), **given)
    except ValidationError as e:
        raise fail("; ".join(": ".join([*map(str, err["loc"]), err["msg"].removeprefix("Value error, ")])
                             for err in e.errors()))
