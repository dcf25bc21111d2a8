"""Commands that read what was learned: status, eval, generate, report. None of them writes a memory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from cli.errors import clear_errors, fail, option_date
from cli.memories import memory_dir, open_memory
from cli.options import AS_JSON, AS_OF, CONSTANT_LAM, HALF_LIFE, MAX_AGE, POLICY, SKIP, TRACKING, WORKDIR
from cli.output import console, emit, table
from cli.settings import evaluation, feed_options
from cli.workdir import use_workdir
from servers import local

if TYPE_CHECKING:
    from monim.core.config import Fields


@feed_options
def status(fields: Fields, workdir: Path = WORKDIR, policy: Optional[str] = POLICY,
           source: Optional[str] = typer.Option(None, "--source", help="The feed the memory learned: name the articles "
                                                "each learned day got after it was learned (late, not learned)."),
           as_json: bool = AS_JSON) -> None:
    """Days committed, tokens seen, entries, MemRate and bytes of the work directory's memories, what
    each forgot (when, why), and the days, tokens trained and bytes of its parametric learners' weights."""
    from monim.status import status as workdir_status

    found = workdir_status(workdir)
    memories, weights = found["memories"], found["weights"]
    chosen = {}
    if memories or not weights:
        root = memory_dir(workdir, policy)
        chosen = memories[root.name] | {"policy": root.name}
        rows = [{"memory": k, "MB": v["bytes"] / 2**20, "B/entry": round(v["bytes_per_entry"]),
                 "MB in all": v["bytes_total"] / 2**20,
                 "learned with": " ".join(f"{f}={x:g}" for f, x in v["learned_with"].items() if x is not None)} | v
                for k, v in memories.items()]
        console.print(table(f"memories in {workdir}", rows, ["memory", "days", "last_day", "entries", "memrate", "MB",
                                                             "B/entry", "MB in all", "learned with"]))
        forgotten = [{"memory": k} | f for k, v in memories.items() for f in v["forgotten"]]
        if forgotten:
            console.print(table("forgotten (never learned again; `monim learn --relearn DAY` brings a day back)",
                                forgotten, ["memory", "when", "what", "reason"]))
        if source is not None:
            chosen["late"] = late_articles(root, source, fields)
    if weights:
        console.print(table(f"weights in {workdir}", [{"learner": k} | v for k, v in weights.items()],
                            ["learner", "days", "last_day", "tokens_trained", "steps", "bytes"]))
    emit(chosen | found, as_json)


def late_articles(root: Path, source: str, fields: Fields | None = None) -> dict[str, list]:
    """The articles each day the memory learned got in the feed after it was learned, printed and returned."""
    from monim.data.feed import StreamError
    from monim.plan import arrivals
    from monim.storage.datastore import Datastore

    with clear_errors(FileNotFoundError, StreamError):
        late = arrivals(source, Datastore.read(root).evaluations(), fields=fields)
    rows = [{"day": d, "article": f"{i} ({date})" if date else i} for d, found in late.items() for i, date in found]
    console.print(table(f"articles {source} got after {root.name} learned their day (not learned)", rows, ["day", "article"])
                  if rows else f"{source}: no article came after its day was learned")
    return late


@feed_options
def evaluate(fields: Fields, workdir: Path = WORKDIR, policy: Optional[str] = POLICY, as_of: Optional[str] = AS_OF,
             source: Optional[str] = typer.Option(None, "--source", help="Score a stream's articles (a file or folder)."),
             start: Optional[str] = typer.Option(None, "--start", help="Its first day (YYYY-MM-DD)."),
             end: Optional[str] = typer.Option(None, "--end", help="Its last day (YYYY-MM-DD)."),
             split: str = typer.Option("test", "--split", help="Which of each day's articles: train, validation or test."),
             period: str = typer.Option("month", "--period", help="month or week: the source's PPL per period."),
             text: Optional[Path] = typer.Option(None, "--text", help="Also score a plain text file (e.g. WikiText)."),
             text_chars: Optional[int] = typer.Option(None, "--text-chars", help="Only the text's first characters."),
             qa: Optional[Path] = typer.Option(None, "--qa", help="Multiple-choice questions (a JSONL file)."),
             shots: int = typer.Option(0, "--shots", help="Solved examples before each question."),
             constant_lam: bool = CONSTANT_LAM, skip: Optional[float] = SKIP, half_life: Optional[float] = HALF_LIFE,
             max_age: Optional[int] = MAX_AGE, as_json: bool = AS_JSON) -> None:
    """PPL and next-word accuracy of the LM alone and with a memory (as of a past day, if asked) on a
    source's articles (overall and per period), a text file, and multiple-choice questions, by the
    evaluation suite's rules."""
    from monim.data.feed import StreamError

    if source is None and text is None and qa is None:
        raise fail("give --source (with --start/--end), --text or --qa")
    e = evaluation(period, None, text, text_chars, 7, qa, str(shots), half_life, max_age)
    memory = open_memory(workdir, policy, as_of, calibrated=False if constant_lam else None, skip_threshold=skip,
                         half_life=half_life, max_age=max_age)
    from monim.evaluation.suite import evaluate_memory

    with clear_errors(FileNotFoundError, StreamError, ValueError):
        result = evaluate_memory(memory, e, source, option_date(start), option_date(end), split, memory.features(workdir / "features"),
                                 fields)
    console.print(table(f"{memory.ds.root.name} as of {result['as_of']}", [result],
                        [k for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]))
    emit(result, as_json)


def generate(prompt: str = typer.Option(..., "--prompt", help="The text to continue."), workdir: Path = WORKDIR,
             policy: Optional[str] = POLICY, as_of: Optional[str] = AS_OF,
             max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to write at most."),
             temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; else sampled at this temperature."),
             top_p: float = typer.Option(1.0, "--top-p", help="Sample from the smallest set of tokens with this much "
                                         "probability, in (0, 1]."),
             seed: int = typer.Option(0, "--seed", help="The sampler's seed (the same seed writes the same text)."),
             sources: bool = typer.Option(False, "--sources", help="List the memorized articles behind each generated "
                                          "sentence."),
             retrieve: bool = typer.Option(False, "--retrieve", help="Put the best article for the prompt (BM25 over the "
                                           "memory's articles) before it, and name it (In-Context RALM)."),
             constant_lam: bool = CONSTANT_LAM, half_life: Optional[float] = HALF_LIFE, max_age: Optional[int] = MAX_AGE,
             as_json: bool = AS_JSON) -> None:
    """Continue a prompt with the up-to-date model (the LM interpolated with a memory), greedy or sampled."""
    from monim.serving.generation import GenerateConfig

    with clear_errors(ValueError):
        cfg = GenerateConfig(max_new_tokens, temperature, top_p, seed, retrieve=retrieve)
    memory = open_memory(workdir, policy, as_of, calibrated=False if constant_lam else None, half_life=half_life,
                         max_age=max_age)
    from monim.serving.generate import generate as generate_text

    with clear_errors(ValueError):
        gen = generate_text(memory.lm, prompt, memory, cfg)
    typer.echo(prompt + gen.text)
    for s in gen.sources:
        console.print(f"retrieved into the context: {s['date']} {s['doc_id']} \"{s['title']}\"", highlight=False)
    if sources:
        for i, sentence in enumerate(gen.sentences, 1):
            found = "; ".join(f"{s['date']} {s['doc_id']} \"{s['title']}\" ({s['weight']:.2f})" for s in sentence["sources"])
            console.print(f"[{i}] {sentence['text'].strip()!r}\n    sources: {found or 'none (the LM alone)'}", highlight=False)
    emit({"policy": memory.ds.root.name, "as_of": memory.days[-1].date if memory.days else None} | gen.as_dict(), as_json)
    local.end_at_once(0)  # all is written: skip the interpreter's teardown of torch and transformers (~0.9 s on 2 cores)


def report(workdir: Path = WORKDIR,
           experiment: Optional[str] = typer.Option(None, "--experiment", help="Default: the work directory's only one."),
           out: Optional[Path] = typer.Option(None, "--out", help="Folder for report.md and its PNGs (default "
                                              "WORKDIR/report)."),
           tracking_uri: Optional[str] = TRACKING) -> None:
    """Write the paper's tables (markdown + PNGs) for the runs logged in MLflow."""
    use_workdir(workdir, api=False)  # a plain function: no Prefect run, no server
    from flows.report import write_report
    from tracking.store import tracking_uri as resolve

    with clear_errors(ValueError):
        path, _ = write_report(experiment, resolve(str(workdir), tracking_uri), str(out or workdir / "report"))
    console.print(f"report: {path}")


def serve_model(workdir: Path = WORKDIR, policy: Optional[str] = POLICY,
                version: Optional[str] = typer.Option(None, "--version", help="Serve this registered version only "
                                                      "(default: follow the `champion` alias as it moves)."),
                follow_seconds: float = typer.Option(10.0, "--follow-seconds", help="How often the `champion` alias "
                                                     "is checked (a new champion is loaded in the background and "
                                                     "swapped in between requests)."),
                host: str = typer.Option("127.0.0.1", "--host", help="The address to listen on."),
                port: int = typer.Option(5001, "--port", help="The port to listen on."),
                max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Limit: tokens a prompt may ask for."),
                max_chars: int = typer.Option(20_000, "--max-chars", help="Limit: characters a text or prompt may have."),
                max_rows: int = typer.Option(32, "--max-rows", help="Limit: rows a request may send."),
                seconds: float = typer.Option(60.0, "--seconds", help="Limit: seconds a request may take, waiting "
                                              "included (a continuation stops there and answers with what it wrote)."),
                tracking_uri: Optional[str] = TRACKING) -> None:
    """Serve a registered Θ over HTTP on one process, following the champion (or one `--version`):
    POST /invocations (MLflow's request format), GET /ping, GET /health, GET /version. Ctrl-C or SIGTERM stop it
    within seconds."""
    import functools
    import logging

    root = memory_dir(workdir, policy)
    use_workdir(workdir, api=False)
    if port and local.free_port(port) != port:  # said at once, not once the LM has loaded (~10 s)
        raise fail(f"--port {port}: something already listens on port {port} (another `monim serve-model`?): stop it, "
                   "or serve on another port (--port N)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    from monim.serving.service import Limits, Service
    from servers.model import SERVED, Follower, serve
    from tracking.served_model import load_theta
    from tracking.store import tracking_uri as resolve
    from tracking.versions import find_version

    if follow_seconds <= 0:
        raise fail(f"--follow-seconds: {follow_seconds:g}; give a number of seconds above 0")
    find = functools.partial(find_version, resolve(str(workdir), tracking_uri), root, version)
    with clear_errors(ValueError):
        found = find()
        memory = load_theta(found)
    service = Service(memory, Limits(max_rows, max_chars, max_new_tokens, seconds), about={k: found[k] for k in SERVED})
    follower = None if version is not None else Follower(service, find, load_theta, follow_seconds)
    console.print(f"serving {found['model']} version {found['version']} (Θ as of {found['as_of']}"
                  f"{', following the champion' if follower else ''}) at http://{host}:{port}: POST /invocations, "
                  "GET /ping, GET /health, GET /version; Ctrl-C stops it", highlight=False)
    serve(service, follower, host, port)
