"""The `monim` command line: learn a news stream day by day, compare policies, evaluate, inspect."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path
from subprocess import Popen
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from flows import servers

if TYPE_CHECKING:  # the CLI imports the library lazily, so that --help is instant
    from monim.config import RunConfig
    from monim.evaluate import EvalConfig

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)
DEMO_WORKDIR = Path("monim-demo")

WORKDIR = typer.Option(Path("monim-work"), "--workdir", help="Where memories, runs and records live.")
AS_JSON = typer.Option(False, "--json", help="Print one JSON object as the last line.")
MODEL = typer.Option(None, "--model", help="LM: alias, .gguf file, local dir or hub name (default SmolLM2-135M).")
TRACKING = typer.Option(None, "--tracking-uri", help="MLflow tracking URI (default: SQLite in the work directory).")
CONSTANT_LAM = typer.Option(False, "--constant-lam", help="Θ uses the constant λ, T instead of the NN calibrator.")
SKIP = typer.Option(None, "--skip", help="Skip retrieval where the calibrator, after a cheap top-16 search, predicts "
                    "λ below this (paper: 0.3).")
CALIBRATION = typer.Option("train", "--calibration", help="Calibration examples: train (a sample of the day's training "
                           "articles, their own near-duplicates left out), yesterday (the sample against the memory "
                           "before the day) or validation (the paper's: the validation articles).")


CLUSTER = typer.Option(None, "--cluster", help="Dask scheduler address (tcp://host:8786): its workers run the LM over "
                       "each day's articles into WORKDIR/features, which they must reach at the same path.")
PERIOD = typer.Option(None, "--period", help="month or week: PPL on each period's test set as of each period's end.")
PERIOD_DOCS = typer.Option(None, "--period-docs", help="Test articles per period (default all).")
TEXT = typer.Option(None, "--text", help="Forgetting probe: a general-domain text (e.g. WikiText).")
TEXT_CHARS = typer.Option(None, "--text-chars", help="Only the text's first characters.")
TEXT_EVERY = typer.Option(7, "--text-every", help="Days between forgetting probes.")
QA = typer.Option(None, "--qa", help="Multiple-choice questions (JSONL) for the final memories.")
WAIT = typer.Option(True, "--wait/--no-wait", help="While another process learns the same run in this work directory: "
                    "wait for it, saying who it is (default), or fail at once.")
SHOTS = typer.Option("0", "--shots", help="Comma-separated numbers of solved examples, e.g. 0,3.")
HALF_LIFE = typer.Option(None, "--half-life", help="Recency: a neighbour's kNN weight halves with every this many days "
                         "of age (nothing is deleted).")
MAX_AGE = typer.Option(None, "--max-age", help="Recency: leave entries older than this many days out of the search.")
TRAIN_TOKENS = typer.Option(4096, "--train-tokens", help="Parametric learners (finetune, mix-review, recadam): training "
                            "tokens per day, first articles first (0: all; 2 CPU cores train SmolLM2 at ~170 tokens/s).")
LR = typer.Option(1e-4, "--lr", help="Parametric learners: Adam's learning rate (chosen on validation articles by "
                 "benchmarks/learner_lr.py).")
REVIEW = typer.Option(None, "--review-text", help="Mix-Review's general-domain text (default: the forgetting probe's "
                      "--text, from after its --text-chars on, so the probe never sees what was reviewed).")


def _learner_params(train_tokens: int, lr: float, review: Optional[Path], text: Optional[Path],
                    text_chars: Optional[int]) -> dict:
    """The parametric learners' settings; Mix-Review reviews text the forgetting probe does not read."""
    params: dict = {"max_tokens": train_tokens or None, "lr": lr}
    if review is not None:
        params["review"] = str(review)
    elif text is not None and text_chars:
        params |= {"review": str(text), "review_from": text_chars}
    return params


def _evaluation(period: Optional[str], period_docs: Optional[int], text: Optional[Path], text_chars: Optional[int],
                text_every: int, qa: Optional[Path], shots: str, half_life: Optional[float] = None,
                max_age: Optional[int] = None) -> Optional[EvalConfig]:
    """The evaluation suite's settings (None: nothing to measure), or a clear error."""
    from monim.evaluate import EvalConfig

    for path in (text, qa):
        if path is not None and not path.is_file():
            raise _fail(f"file not found: {path}")
    try:
        e = EvalConfig(period, period_docs, str(text) if text else None, text_chars, text_every,
                       str(qa) if qa else None, tuple(int(k) for k in shots.split(",")), half_life=half_life,
                       max_age=max_age)
    except ValueError as err:
        raise _fail(str(err))
    if not (e.period or e.text or e.qa):
        if e.recency.active:
            raise _fail("--half-life and --max-age apply to the evaluation suite: give --period, --text or --qa too")
        return None
    return e


def _recency(half_life: Optional[float], max_age: Optional[int]):
    """The recency rule of --half-life and --max-age, or a clear error."""
    from monim.recency import Recency

    try:
        return Recency(half_life, max_age)
    except ValueError as e:
        raise _fail(str(e))


def _calibrator_params(skip: Optional[float], calibration: str = "train") -> dict:
    from monim.calibrator import SOURCES

    if calibration not in SOURCES:
        raise _fail(f"--calibration must be one of {', '.join(SOURCES)}, not {calibration!r}")
    return {"source": calibration} | ({} if skip is None else {"skip_threshold": skip})


def _run_config(**fields) -> RunConfig:
    """The run's typed spec, or a clear error naming the field."""
    from pydantic import ValidationError

    from monim.config import RunConfig

    try:
        return RunConfig(**fields)
    except ValidationError as e:
        raise _fail("; ".join(": ".join([*map(str, err["loc"]), err["msg"].removeprefix("Value error, ")])
                              for err in e.errors()))


@contextmanager
def _not_waiting() -> Iterator[None]:
    """A run held by another process (with --no-wait) is a clear error, not a traceback."""
    from monim.lock import Locked

    try:
        yield
    except Locked as e:
        raise _fail(str(e))


def _fail(message: str) -> typer.Exit:
    """Say what is wrong in one line on stderr; exit status 2."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def use_workdir(workdir: Path, api: bool = True) -> None:
    """Point Prefect's local state at the work directory (unless a server or home is configured) and,
    for a command that runs flows, start its Prefect API; SIGTERM stops the command like Ctrl-C."""
    workdir.mkdir(parents=True, exist_ok=True)
    servers.interruptible()
    if "PREFECT_API_URL" not in os.environ:
        os.environ.setdefault("PREFECT_HOME", str((workdir / "prefect").resolve()))
        if api:
            os.environ["PREFECT_API_URL"] = servers.prefect_api()
    import tasks  # noqa: F401  (the rest of the environment, before Prefect is imported)


def _emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=str))


def _check_source(source: str, start: Optional[str], end: Optional[str]) -> list:
    """The dates with articles, or a clear error for a missing file or an empty range."""
    from monim.stream import StreamError, list_dates

    try:
        dates = list_dates(source, _day(start), _day(end))
    except (FileNotFoundError, StreamError) as e:
        raise _fail(str(e))
    if not dates:
        raise _fail(f"{source} has no articles between {start or 'the start'} and {end or 'the end'}")
    return dates


def _day(value: Optional[str]) -> Optional[dt.date]:
    if value is None:
        return None
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise _fail(f"not a date (YYYY-MM-DD): {value!r}")


def _check_model(workdir: Path, model: Optional[str]) -> None:
    """Refuse a work directory whose memories were built by another model, before any work."""
    from monim.datastore import Datastore

    want = model or "smollm2-135m"
    for root in _memories(workdir):
        built = Datastore.read(root).manifest["model"]
        if built != want:
            raise _fail(f"{root} was built with model {built!r}, not {want!r}: use another --workdir")


def _memories(workdir: Path) -> list[Path]:
    """The memory directories of a work directory, one per policy."""
    return sorted(p.parent for p in (workdir / "memories").glob("*/manifest.json"))


def _status_of(root: Path) -> dict:
    from monim.datastore import Datastore
    from monim.index import index_bytes

    ds = Datastore.read(root)
    size = ds.bytes_on_disk() + index_bytes(root)
    return {"days": len(ds.days), "tokens_seen": ds.tokens_seen, "entries": len(ds), "memrate": ds.memrate,
            "bytes": size, "bytes_per_entry": size / len(ds) if len(ds) else 0.0, "model": ds.manifest["model"],
            "last_day": ds.days[-1].date if ds.days else None,
            "memrate_by_day": {d.date: d.memrate for d in ds.days}}


def _table(title: str, rows: list[dict], columns: list[str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))  # fits 80 columns
    for col in columns:
        table.add_column(col, justify="left" if col == columns[0] else "right")
    for r in rows:
        table.add_row(*[f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in columns])
    return table


SUMMARY_COLUMNS = ["policy", "days", "entries", "memrate", "ppl_lm", "ppl", "accuracy", "MB", "s/day"]


def _summary_rows(summary: dict[str, dict]) -> list[dict]:
    return [{"policy": p} | s | {"MB": s["bytes"] / 2**20, "s/day": s["seconds_per_day"]} for p, s in summary.items()]


@app.command()
def run(days: int = typer.Option(4, help="Days of the bundled Reuters stream."),
        max_docs: int = typer.Option(16, help="Training articles per day."),
        workdir: Path = typer.Option(DEMO_WORKDIR, "--workdir"), model: Optional[str] = MODEL,
        as_json: bool = AS_JSON) -> None:
    """The demo: FullMem vs MoNIM-AMT on the bundled stream, through the real flows."""
    from monim.stream import DEMO_STREAM

    dates = _check_source(str(DEMO_STREAM), None, None)[:days]
    _check_model(workdir, model)
    use_workdir(workdir)
    from flows.compare import compare_policies

    spec = _run_config(source=str(DEMO_STREAM), workdir=str(workdir), model=model, max_docs=max_docs)
    summary = compare_policies(spec, dates[0].isoformat(), dates[-1].isoformat(), ["fullmem", "monim-amt"])
    console.print(_table(f"Reuters-21578 demo, {dates[0]}..{dates[-1]}, <= {max_docs} training articles a day",
                         _summary_rows(summary), SUMMARY_COLUMNS))
    console.print(f"Prefect runs: PREFECT_HOME={os.environ.get('PREFECT_HOME')}  ·  MLflow: "
                  f"{(workdir / 'mlflow.db').resolve()}  ·  report: {workdir / 'report' / 'report.md'}")
    console.print(f"\nOnce `monim ui --workdir {workdir}` runs, the runs and models are at:")
    _print_links(workdir, "http://127.0.0.1:5000", "http://127.0.0.1:4200")
    _print_next_steps(workdir, spec.model_copy(update={"policy": "monim-amt"}))
    _emit({"workdir": str(workdir), "policies": summary}, as_json)


@app.command()
def learn(source: str = typer.Option(..., help="JSONL/News Crawl file, or hf:NAME."),
          start: Optional[str] = typer.Option(None), end: Optional[str] = typer.Option(None),
          policy: str = typer.Option("monim-amt", help="fullmem, randmem, monim, monim-amt, kl, greedy-merge, or a "
                                     "parametric learner: finetune, mix-review, recadam."),
          workdir: Path = WORKDIR, model: Optional[str] = MODEL,
          max_docs: Optional[int] = typer.Option(None, help="Cap on training articles per day."),
          constant_lam: bool = CONSTANT_LAM, skip: Optional[float] = SKIP, calibration: str = CALIBRATION,
          period: Optional[str] = PERIOD, period_docs: Optional[int] = PERIOD_DOCS, text: Optional[Path] = TEXT,
          text_chars: Optional[int] = TEXT_CHARS, text_every: int = TEXT_EVERY, qa: Optional[Path] = QA,
          shots: str = SHOTS, half_life: Optional[float] = HALF_LIFE, max_age: Optional[int] = MAX_AGE,
          train_tokens: int = TRAIN_TOKENS, lr: float = LR, review: Optional[Path] = REVIEW,
          tracking_uri: Optional[str] = TRACKING,
          feature_store: bool = typer.Option(True, "--feature-store/--no-feature-store",
                                             help="Keep the LM's features in WORKDIR/features for other policies and "
                                                  "re-runs (off: nothing kept; for a single-policy production run)."),
          cluster: Optional[str] = CLUSTER, wait: bool = WAIT, as_json: bool = AS_JSON) -> None:
    """Learn the stream's days from START to END into the work directory with one policy (then
    run the evaluation suite on it if asked)."""
    spec = _run_config(source=source, policy=policy, workdir=str(workdir), model=model, max_docs=max_docs,
                       calibrated=not constant_lam, calibrator_params=_calibrator_params(skip, calibration),
                       learner_params=_learner_params(train_tokens, lr, review, text, text_chars),
                       feature_store=feature_store, cluster=cluster)
    _check_source(source, start, end)
    _check_model(workdir, model)
    evaluation = _evaluation(period, period_docs, text, text_chars, text_every, qa, shots, half_life, max_age)
    use_workdir(workdir)
    from flows.stream import learn_stream

    with _not_waiting():
        rows = learn_stream(spec, start, end, tracking_uri=tracking_uri, evaluation=evaluation, wait=wait)
    name = spec.name
    console.print(_table(f"{name} on {source}", rows, ["date", "tokens_seen", "entries_stored", "memrate_day",
                                                        "entries", "ppl_lm", "ppl", "accuracy"]))
    root = workdir / "memories" / name  # the bare LM and a parametric learner keep no memory
    _emit((_status_of(root) if (root / "manifest.json").exists() else {}) | {"policy": name, "rows": rows}, as_json)


@app.command()
def compare(source: str = typer.Option(...), start: Optional[str] = typer.Option(None), end: Optional[str] = typer.Option(None),
            policies: str = typer.Option("bare,fullmem,randmem,monim-amt", help="Comma-separated policies."),
            workdir: Path = WORKDIR, model: Optional[str] = MODEL, max_docs: Optional[int] = typer.Option(None),
            constant_lam: bool = CONSTANT_LAM, skip: Optional[float] = SKIP, calibration: str = CALIBRATION,
            period: Optional[str] = PERIOD, period_docs: Optional[int] = PERIOD_DOCS, text: Optional[Path] = TEXT,
            text_chars: Optional[int] = TEXT_CHARS, text_every: int = TEXT_EVERY, qa: Optional[Path] = QA,
            shots: str = SHOTS, half_life: Optional[float] = HALF_LIFE, max_age: Optional[int] = MAX_AGE,
            train_tokens: int = TRAIN_TOKENS, lr: float = LR, review: Optional[Path] = REVIEW,
            tracking_uri: Optional[str] = TRACKING, cluster: Optional[str] = CLUSTER,
            wait: bool = WAIT, as_json: bool = AS_JSON) -> None:
    """Run several policies over the same days into one MLflow experiment, evaluate, and report."""
    spec = _run_config(source=source, workdir=str(workdir), model=model, max_docs=max_docs, calibrated=not constant_lam,
                       calibrator_params=_calibrator_params(skip, calibration), cluster=cluster,
                       learner_params=_learner_params(train_tokens, lr, review, text, text_chars))
    for policy in policies.split(","):
        _run_config(**spec.model_dump() | {"policy": policy})
    _check_source(source, start, end)
    _check_model(workdir, model)
    evaluation = _evaluation(period, period_docs, text, text_chars, text_every, qa, shots, half_life, max_age)
    use_workdir(workdir)
    from flows.compare import compare_policies

    with _not_waiting():
        summary = compare_policies(spec, start, end, policies.split(","), tracking_uri=tracking_uri,
                                   evaluation=evaluation, wait=wait)
    console.print(_table(f"policies on {source}", _summary_rows(summary), SUMMARY_COLUMNS))
    console.print(f"report: {workdir / 'report' / 'report.md'}")
    _emit({"policies": summary, "report": str(workdir / "report" / "report.md")}, as_json)


@app.command("eval")
def evaluate(workdir: Path = WORKDIR, as_of: Optional[str] = typer.Option(None, "--as-of", help="Use the memory as it stood after this day."),
             source: Optional[str] = typer.Option(None), start: Optional[str] = typer.Option(None),
             end: Optional[str] = typer.Option(None), split: str = typer.Option("test"),
             period: str = typer.Option("month", help="month or week: the source's PPL per period."),
             text: Optional[Path] = typer.Option(None, help="Also score a plain text file (e.g. WikiText): ppl_text."),
             text_chars: Optional[int] = typer.Option(None, help="Only the text's first characters."),
             qa: Optional[Path] = typer.Option(None, help="Multiple-choice questions (JSONL): qa_accuracy."),
             shots: int = typer.Option(0, help="Solved examples before each question."),
             policy: Optional[str] = typer.Option(None, help="Which memory (default: the only one, else monim-amt)."),
             constant_lam: bool = CONSTANT_LAM, skip: Optional[float] = SKIP, half_life: Optional[float] = HALF_LIFE,
             max_age: Optional[int] = MAX_AGE, as_json: bool = AS_JSON) -> None:
    """PPL and next-word accuracy of the LM alone and with a memory (optionally as of a past day) on
    a source's articles (overall and per period), a text file, and multiple-choice questions."""
    if source is None and text is None and qa is None:
        raise _fail("give --source (with --start/--end), --text or --qa")
    if period not in ("month", "week"):
        raise _fail(f"--period must be month or week, not {period!r}")
    root = _memory_dir(workdir, policy)
    from monim.calibrator import CalibratorConfig
    from monim.datastore import Datastore
    from monim.evaluate import combine, evaluate_many, period_sets, text_document
    from monim.features import Features
    from monim.lm import load_lm
    from monim.scoring import ScoreConfig
    from monim.memory import Memory
    from monim.qa import answer_questions, read_questions
    from monim.stream import StreamError

    if source is not None:
        _check_source(source, start, end)
    if text is not None and not text.is_file():
        raise _fail(f"text file not found: {text}")
    lm = load_lm(Datastore.read(root).manifest["model"])
    features = Features(lm, ScoreConfig(), workdir / "features")  # the learning runs' features, where they fit
    memory = Memory(root, lm, calibrator_cfg=CalibratorConfig(skip_threshold=skip), use_calibrator=not constant_lam,
                    as_of=_day(as_of), recency=_recency(half_life, max_age))
    result: dict = {"policy": root.name, "as_of": memory.days[-1].date if memory.days else None, "entries": len(memory)}
    if qa is not None:  # read first: a bad file or an empty range fails before any scoring
        days = memory.days
        first = dt.date.fromisoformat(days[0].date) if days else None
        last = dt.date.fromisoformat(days[-1].date) + dt.timedelta(days=7) if days else None
        try:
            questions, pool = read_questions(qa, first, last), read_questions(qa)
        except (FileNotFoundError, StreamError) as e:
            raise _fail(str(e))
        if not questions:
            raise _fail(f"{qa} has no questions dated {first}..{last} (the memory's days and a week after)")
    if source is not None:
        sets = period_sets(source, _day(start), _day(end), period, split=split)
        by_period = {p: evaluate_many(lm, docs, {"m": memory}, features, f"period-{p}")["m"] for p, docs in sets.items()}
        result |= combine(list(by_period.values())) | {"documents": sum(len(d) for d in sets.values()),
                                                       f"ppl_by_{period}": {p: r["ppl"] for p, r in by_period.items()},
                                                       f"ppl_lm_by_{period}": {p: r["ppl_lm"] for p, r in by_period.items()}}
    if text is not None:
        r = evaluate_many(lm, [text_document(text, text_chars)], {"m": memory}, features, f"text-{text.name}")["m"]
        result |= {"ppl_text": r["ppl"], "ppl_text_lm": r["ppl_lm"], "text_tokens": r["tokens"]}
    if qa is not None:
        answers = answer_questions(lm, questions, {"m": memory, "lm": None}, shots, pool)
        result |= answers["m"] | {"qa_accuracy_lm": answers["lm"]["qa_accuracy"], "qa_shots": shots}
    console.print(_table(f"{root.name} as of {result['as_of']}", [result],
                         [k for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]))
    _emit(result, as_json)


@app.command()
def generate(prompt: str = typer.Option(..., "--prompt", help="The text to continue."), workdir: Path = WORKDIR,
             policy: Optional[str] = typer.Option(None, help="Which memory (default: the only one, else monim-amt)."),
             as_of: Optional[str] = typer.Option(None, "--as-of", help="Use the memory as it stood after this day."),
             max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
             temperature: float = typer.Option(0.0, help="0: greedy; else sampled at this temperature."),
             top_p: float = typer.Option(1.0, "--top-p", help="Sample from the smallest set of tokens with this much probability."),
             seed: int = typer.Option(0), sources: bool = typer.Option(False, "--sources", help="List the memorized "
                                                                        "articles behind each generated sentence."),
             constant_lam: bool = CONSTANT_LAM, half_life: Optional[float] = HALF_LIFE, max_age: Optional[int] = MAX_AGE,
             as_json: bool = AS_JSON) -> None:
    """Continue a prompt with the up-to-date model (the LM interpolated with a memory), greedy or sampled."""
    root = _memory_dir(workdir, policy)
    from monim.datastore import Datastore
    from monim.generate import GenerateConfig, generate as generate_text
    from monim.lm import load_lm
    from monim.memory import Memory

    try:
        cfg = GenerateConfig(max_new_tokens, temperature, top_p, seed)
    except ValueError as e:
        raise _fail(str(e))
    lm = load_lm(Datastore.read(root).manifest["model"])
    memory = Memory(root, lm, use_calibrator=not constant_lam, as_of=_day(as_of), recency=_recency(half_life, max_age))
    try:
        gen = generate_text(lm, prompt, memory, cfg)
    except ValueError as e:
        raise _fail(str(e))
    typer.echo(prompt + gen.text)
    if sources:
        for i, sentence in enumerate(gen.sentences, 1):
            found = "; ".join(f"{s['date']} {s['doc_id']} \"{s['title']}\" ({s['weight']:.2f})" for s in sentence["sources"])
            console.print(f"[{i}] {sentence['text'].strip()!r}\n    sources: {found or 'none (the LM alone)'}", highlight=False)
    _emit({"policy": root.name, "as_of": memory.days[-1].date if memory.days else None} | gen.as_dict(), as_json)


@app.command()
def report(workdir: Path = WORKDIR, experiment: Optional[str] = typer.Option(None, help="Default: the work directory's only one."),
           out: Optional[Path] = typer.Option(None, help="Folder for report.md and its PNGs (default WORKDIR/report)."),
           tracking_uri: Optional[str] = TRACKING) -> None:
    """Write the paper's tables (markdown + PNGs) for the runs logged in MLflow."""
    use_workdir(workdir)
    from tasks.tracking import client, tracking_uri as resolve

    uri = resolve(str(workdir), tracking_uri)
    if experiment is None:
        names = [e.name for e in client(uri).search_experiments() if e.name != "Default"]
        if len(names) != 1:
            raise _fail(f"give --experiment: {uri} has {len(names)} experiments ({', '.join(names) or 'none'})")
        experiment = names[0]
    from flows.report import report_runs

    try:
        path = report_runs(experiment, uri, str(out or workdir / "report"))
    except ValueError as e:
        raise _fail(str(e))
    console.print(f"report: {path}")


@app.command()
def fsck(workdir: Path = WORKDIR, repair: bool = typer.Option(False, "--repair", help="Rebuild what is derived (index, "
                                                              "lexical counts, records, MLflow steps) and remove strays."),
         tracking_uri: Optional[str] = TRACKING, as_json: bool = AS_JSON) -> None:
    """Check every memory against its manifest (shards, checksums, index, strays), run records and
    MLflow's steps against them; exit status 1 when something is wrong (and not repaired)."""
    if not (workdir / "memories").is_dir() and not (workdir / "runs").is_dir():
        raise _fail(f"no work directory at {workdir} (no memories/ or runs/)")
    use_workdir(workdir)
    from flows.fsck import check_workdir

    problems = check_workdir(str(workdir), tracking_uri, repair)
    wrong = [p for p in problems if not p["repaired"]]
    if problems:
        console.print(_table(f"fsck {workdir}", problems, ["where", "what", "repair", "repaired"]))
    console.print(f"{len(problems)} problems, {len(problems) - len(wrong)} repaired" if problems else f"{workdir}: clean")
    _emit({"clean": not wrong, "problems": problems}, as_json)
    if wrong:
        raise typer.Exit(1)


@app.command()
def gc(workdir: Path = WORKDIR, keep_days: Optional[int] = typer.Option(None, "--keep-days", help="Keep the LM features of the newest N days."),
       max_gb: Optional[float] = typer.Option(None, "--max-gb", help="Then keep the newest features that fit in this size."),
       as_json: bool = AS_JSON) -> None:
    """Clean the work directory's feature store (memories are never touched)."""
    from monim.features import gc as clean

    if keep_days is None and max_gb is None:
        raise _fail("give --keep-days N and/or --max-gb X")
    out = clean(workdir / "features", keep_days, None if max_gb is None else int(max_gb * 2**30))
    console.print(f"feature store: removed {out['removed']} folders, {out['bytes_before'] / 2**20:.1f} MB -> "
                  f"{out['bytes_after'] / 2**20:.1f} MB")
    _emit(out, as_json)


def _memory_dir(workdir: Path, policy: Optional[str]) -> Path:
    found = _memories(workdir)
    if not found:
        raise _fail(f"no memory in {workdir} (run `monim learn` first)")
    if policy:
        match = [p for p in found if p.name == policy]
        if not match:
            raise _fail(f"no {policy!r} memory in {workdir}; there are: {', '.join(p.name for p in found)}")
        return match[0]
    return found[0] if len(found) == 1 else next((p for p in found if p.name == "monim-amt"), found[0])


def _weights_of(root: Path) -> dict:
    from monim.parametric import Weights

    weights = Weights(root)
    metas = [weights.meta(d) for d in weights.days()]
    return {"days": len(metas), "last_day": metas[-1]["date"] if metas else None, "bytes": weights.bytes_on_disk(),
            "tokens_trained": sum(m["tokens_trained"] for m in metas), "steps": metas[-1]["step"] if metas else 0}


@app.command()
def status(workdir: Path = WORKDIR, policy: Optional[str] = typer.Option(None), as_json: bool = AS_JSON) -> None:
    """Days committed, tokens seen, entries, MemRate and bytes of the work directory's memories, and the
    days, tokens trained and bytes of its parametric learners' weights."""
    weights = {p.name: _weights_of(p) for p in sorted((workdir / "weights").glob("*")) if p.is_dir()}
    memories = {root.name: _status_of(root) for root in _memories(workdir)}
    chosen = {}
    if memories or not weights:
        root = _memory_dir(workdir, policy)
        chosen = memories[root.name] | {"policy": root.name}
        console.print(_table(f"memories in {workdir}", [{"memory": k} | v for k, v in memories.items()],
                             ["memory", "days", "last_day", "tokens_seen", "entries", "memrate", "bytes"]))
    if weights:
        console.print(_table(f"weights in {workdir}", [{"learner": k} | v for k, v in weights.items()],
                             ["learner", "days", "last_day", "tokens_trained", "steps", "bytes"]))
    _emit(chosen | {"memories": memories, "weights": weights}, as_json)


@app.command()
def forget(workdir: Path = WORKDIR, doc: Optional[list[str]] = typer.Option(None, help="Document id (repeatable)."),
           day: Optional[list[str]] = typer.Option(None, help="Date YYYY-MM-DD (repeatable)."),
           policy: Optional[str] = typer.Option(None, help="Only this memory (default: all of them)."),
           as_json: bool = AS_JSON) -> None:
    """Remove retracted documents or whole days from the memories, and from their indexes."""
    from monim.datastore import Datastore
    from monim.index import MemoryIndex

    if not doc and not day:
        raise _fail("give --doc ID or --day DATE")
    roots = [_memory_dir(workdir, policy)] if policy else _memories(workdir)
    removed = {}
    for root in roots:
        ds = Datastore.read(root)
        removed[root.name] = ds.forget(doc_ids=doc, days=[_day(d) for d in day or []])
        MemoryIndex(root, ds.identity["hidden_size"]).sync(ds)
    console.print(f"removed entries: {removed}")
    _emit({"removed": removed}, as_json)


def _started(server: Callable[..., Popen], *args) -> Popen:
    """A server from `flows.servers`, or a clean exit saying why it did not start."""
    try:
        return server(*args)
    except RuntimeError as e:
        raise _fail(str(e))


@app.command()
def serve(source: str = typer.Option(..., help="The news feed the daily run reads."), workdir: Path = WORKDIR,
          policy: str = typer.Option("monim-amt"), cron: str = typer.Option("30 2 * * *"),
          timezone: str = typer.Option("UTC"), model: Optional[str] = MODEL, cluster: Optional[str] = CLUSTER,
          prefect_port: int = typer.Option(4200, help="Port of the Prefect server started when none is configured.")) -> None:
    """Serve the daily (cron, learns yesterday) and backfill deployments from this process.

    Without PREFECT_API_URL a Prefect server is started on 127.0.0.1 for the work directory
    (Prefect's temporary server does not run schedules); Ctrl-C stops both.
    """
    use_workdir(workdir, api=False)
    procs: list[Popen] = []
    if "PREFECT_API_URL" not in os.environ:
        port = servers.free_port(prefect_port)
        procs.append(_started(servers.prefect_server, port))
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        console.print(f"Prefect server and UI: http://127.0.0.1:{port}")
    try:
        from prefect import serve as prefect_serve
        from prefect.schedules import Cron

        from flows.stream import learn_stream, learn_yesterday

        params = {"run": _run_config(source=source, workdir=str(workdir.resolve()), policy=policy, model=model,
                                     cluster=cluster).model_dump()}
        prefect_serve(
            learn_yesterday.to_deployment(name="daily", schedule=Cron(cron, timezone=timezone),
                                          parameters=params | {"timezone": timezone}),
            learn_stream.to_deployment(name="backfill", parameters=params),
        )
    finally:
        servers.stop(procs)


def _print_links(workdir: Path, mlflow_url: str, prefect_url: str) -> None:
    from tasks.tracking import tracking_uri, ui_links

    console.print(f"Prefect UI: {prefect_url}\nMLflow UI:  {mlflow_url}")
    for what, url in ui_links(tracking_uri(str(workdir)), mlflow_url, prefect_url):
        console.print(f"  {what}: {url}", highlight=False, soft_wrap=True)


def _print_next_steps(workdir: Path, spec: RunConfig) -> None:
    """How to use the up-to-date model: generate with sources, serve its champion, query it."""
    from tasks.registry import model_name
    from tasks.tracking import tracking_uri

    uri = tracking_uri(str(workdir))
    console.print(
        "\nAsk the up-to-date model (MoNIM-AMT's memory):\n"
        f"  monim generate --workdir {workdir} --prompt 'The Bank of Japan said' --sources\n"
        "Serve its champion version over HTTP, and query it:\n"
        f"  MLFLOW_TRACKING_URI={uri} mlflow models serve -m 'models:/{model_name(spec)}@champion' "
        "--env-manager local -h 127.0.0.1 -p 5001\n"
        "  curl -s http://127.0.0.1:5001/invocations -H 'Content-Type: application/json' "
        "-d '{\"dataframe_records\": [{\"prompt\": \"The Bank of Japan said\"}], \"params\": {\"max_new_tokens\": 20}}'",
        highlight=False, soft_wrap=True)


def _registry_call(workdir: Path, policy: Optional[str], tracking: Optional[str], fn: Callable, *args) -> dict:
    """A tasks.registry function on the memory's registered model, or a clear error."""
    root = _memory_dir(workdir, policy)
    use_workdir(workdir, api=False)
    from tasks.tracking import tracking_uri

    try:
        return fn(tracking_uri(str(workdir), tracking), root, *args)
    except ValueError as e:
        raise _fail(str(e))


@app.command()
def promote(workdir: Path = WORKDIR, policy: Optional[str] = typer.Option(None), version: Optional[str] = typer.Option(
            None, help="The version to serve (default: the newest)."), tracking_uri: Optional[str] = TRACKING,
            as_json: bool = AS_JSON) -> None:
    """Point the registered model's `champion` alias at a version by hand (`previous` keeps the old one)."""
    from tasks.registry import promote as promote_version

    result = _registry_call(workdir, policy, tracking_uri, promote_version, version)
    console.print(f"{result['model']}: champion is version {result['champion']} (previous: {result['previous']})")
    _emit(result, as_json)


@app.command()
def rollback(workdir: Path = WORKDIR, policy: Optional[str] = typer.Option(None), tracking_uri: Optional[str] = TRACKING,
             as_json: bool = AS_JSON) -> None:
    """Move `champion` back to the `previous` version."""
    from tasks.registry import rollback as rollback_version

    result = _registry_call(workdir, policy, tracking_uri, rollback_version)
    console.print(f"{result['model']}: champion is version {result['champion']} again")
    _emit(result, as_json)


@app.command()
def ui(workdir: Path = WORKDIR, prefect_port: int = typer.Option(4200), mlflow_port: int = typer.Option(5000)) -> None:
    """Start the Prefect UI and the MLflow UI on 127.0.0.1 over the work directory; Ctrl-C stops both."""
    use_workdir(workdir, api=False)
    prefect_port, mlflow_port = servers.free_port(prefect_port), servers.free_port(mlflow_port)
    procs: list[Popen] = []
    try:
        procs.append(_started(servers.prefect_server, prefect_port))
        procs.append(_started(servers.mlflow_server, mlflow_port, workdir))
        _print_links(workdir, f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}")
        console.print("Ctrl-C stops both.")
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        servers.stop(procs)
