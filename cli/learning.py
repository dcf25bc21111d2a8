"""Commands that learn: the demo, one run, a comparison, and the daily deployments."""

from __future__ import annotations

import datetime as dt
import logging
import os
from pathlib import Path
from subprocess import Popen
from typing import TYPE_CHECKING, Optional

import typer

from cli.errors import clear_errors, fail, option_date
from cli.options import AS_JSON, MODEL, WORKDIR
from cli.output import console, emit, table
from cli.plans import check_plans, refused_plans
from cli.room import said_when_full
from cli.settings import learning_options
from cli.workdir import prefect_home, use_tracking, use_workdir
from monim.core import catalogue  # names and help only: no torch
from servers import local

if TYPE_CHECKING:
    from monim.core.config import EvalConfig
    from monim.core.run_config import RunConfig
    from monim.plan import Plan

# what each policy achieved, then what it cost (two tables: each fits 80 columns)
SUMMARY_COLUMNS = ["policy", "days", "entries", "memrate", "ppl_lm", "ppl", "ppl_novel", "accuracy"]
COST_COLUMNS = ["policy", "MB", "learning s/day", "scoring s/1k tokens", "LM tokens/token"]


def preflight(cfg: RunConfig, policies: list[str], lm: bool = True) -> None:
    """Refuse, before any work, another model or other settings (monim.run.refuse_others), in one line; without
    `lm`, only what needs no LM (monim.plan.refuse_settings: not the LM's weights and tokenizer)."""
    from monim.core.manifest import ManifestError, MemoryMismatch
    from monim.storage.memory_settings import SettingsMismatch

    with clear_errors(ManifestError, SettingsMismatch, MemoryMismatch):
        if lm:
            from monim.run import refuse_others

            refuse_others(cfg, policies)
        else:
            from monim.plan import refuse_settings

            refuse_settings(cfg, policies)


def nothing_new(cfg: RunConfig, plans: dict[str, Plan], evaluation: Optional[EvalConfig], workdir: Path,
                tracking_uri: Optional[str], wait: bool, comparison: bool = False) -> dict[str, list[dict]] | None:
    """What nothing_new_held answers, holding each policy's run as its flow would (waiting for a writer, or refused at once
    with --no-wait): what a writer is learning is never answered from."""
    from contextlib import ExitStack

    from monim.core.lock import hold
    from monim.storage.workdirs import run_lock

    if evaluation is not None or not all(p.nothing_new for p in plans.values()):
        return None
    names = {policy: cfg.model_copy(update={"policy": policy}).name for policy in plans}
    with clear_errors(), ExitStack() as held:
        for name in names.values():
            held.enter_context(hold(run_lock(cfg.workdir, name), wait,
                                    say=lambda m: console.print(m, style="yellow", highlight=False)))
        return nothing_new_held(cfg, plans, names, workdir, tracking_uri, comparison)


def nothing_new_held(cfg: RunConfig, plans: dict[str, Plan], names: dict[str, str], workdir: Path,
                     tracking_uri: Optional[str], comparison: bool = False) -> dict[str, list[dict]] | None:
    """Each policy's rows of the range where the command has nothing to do but say them: no day to learn and
    no record arrived for a learned day since it was learned (monim.plan.Plan.nothing_new), nothing to
    measure, and each run tracked in the work directory's MLflow store; for a `comparison`, each in the
    comparison's run, which holds these totals side by side, and its report written. Then the command answers
    from the work directory, starting no server and loading no LM; else None (the flows run)."""
    from monim.evaluation.totals import summarize
    from monim.storage.workdirs import memory_root, read_rows
    from tracking.logged import side_by_side
    from tracking.store import latest_metrics, sqlite_file, tracked, tracking_uri as resolve

    db = sqlite_file(resolve(str(workdir), tracking_uri))
    if db is None or not db.exists():
        return None
    uri = use_tracking(workdir, tracking_uri)  # a damaged store is refused here, as before a run
    group = tracked(uri, {"monim.kind": "comparison", "monim.workdir": str(workdir.resolve())}) if comparison else None
    if comparison and (group is None or not (workdir / "report" / "report.md").exists()):
        return None
    tags = {"monim.comparison": group} if group else {}
    if not all(tracked(uri, {"monim.memory": str(memory_root(cfg.workdir, name).resolve())} | tags) for name in names.values()):
        return None
    rows = {policy: [r for d, r in sorted(read_rows(cfg.workdir, names[policy]).items())
                     if dt.date.fromisoformat(d) in todo.dates] for policy, todo in plans.items()}
    if group and not side_by_side({p: summarize(r) for p, r in rows.items()}).items() <= latest_metrics(uri, group).items():
        return None
    for policy, todo in plans.items():
        for level, message in todo.said(names[policy]):
            console.print(message, style="yellow" if level >= logging.WARNING else None, highlight=False, soft_wrap=True)
    return rows


def summary_rows(summary: dict[str, dict]) -> list[dict]:
    return [{"policy": p} | s | {"MB": s["bytes"] / 2**20, "learning s/day": s["seconds_per_day"],
                                 "scoring s/1k tokens": s["seconds_score_per_1k"], "LM tokens/token": s["lm_tokens_per_token"]}
            for p, s in summary.items()]


def print_summary(title: str, summary: dict[str, dict]) -> None:
    """A comparison's two tables: what each policy achieved, and what it cost."""
    rows = summary_rows(summary)
    console.print(table(title, rows, SUMMARY_COLUMNS))
    console.print(table("what each cost (scoring: beyond the LM's pass over the test text)", rows, COST_COLUMNS))


def run(days: int = typer.Option(4, "--days", help="Days of the bundled Reuters stream."),
        max_docs: int = typer.Option(16, "--max-docs", help="Training articles a day."),
        workdir: Path = typer.Option(Path("monim-demo"), "--workdir", help="Where the demo's runs live (a folder)."),
        model: Optional[str] = MODEL, as_json: bool = AS_JSON) -> None:
    """The demo: FullMem vs MoNIM-AMT on the bundled stream, through the real flows."""
    from cli.settings import config_from_options
    from monim.core.config import DEMO_STREAM
    from monim.data.stream import list_dates

    cfg = config_from_options(source=str(DEMO_STREAM), workdir=workdir, model=model, max_docs=max_docs)
    dates = list_dates(DEMO_STREAM)[:days]  # from its day index: no record read
    check_plans(cfg, dates[0].isoformat(), dates[-1].isoformat(), ["fullmem", "monim-amt"])
    preflight(cfg, ["fullmem", "monim-amt"])
    use_workdir(workdir)
    use_tracking(workdir, None)
    from flows.compare import compare_policies

    with refused_plans():
        summary = compare_policies(cfg, dates[0].isoformat(), dates[-1].isoformat(), ["fullmem", "monim-amt"])
    print_summary(f"Reuters-21578 demo, {dates[0]}..{dates[-1]}, <= {max_docs} training articles a day", summary)
    console.print(f"MLflow: {(workdir / 'mlflow.db').resolve()}  ·  report: {workdir / 'report' / 'report.md'}")
    console.print(f"\nOnce `monim ui --workdir {workdir}` runs, the runs and models are at:")
    print_links(workdir, "http://127.0.0.1:5000", "http://127.0.0.1:4200")
    print_next_steps(workdir)
    emit({"workdir": str(workdir), "policies": summary}, as_json)


def demo_feed(path: Path = typer.Argument(..., help="Where to write it: a .jsonl.gz file (gzipped), else plain JSONL.")
              ) -> None:
    """Write the bundled news stream (Reuters-21578, 1987-03-02..03-13, one JSON article a line) to PATH."""
    import gzip
    import json
    import shutil

    from monim.core.config import DEMO_STREAM

    if path.exists():
        raise fail(f"{path} exists: name a new file")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        shutil.copyfile(DEMO_STREAM, path)
    else:
        with gzip.open(DEMO_STREAM, "rb") as src, path.open("wb") as out:
            shutil.copyfileobj(src, out)
    with gzip.open(DEMO_STREAM, "rt") as src:
        days = [json.loads(line)["date"] for line in src]
    console.print(f"{path}: {len(days)} articles on {len(set(days))} days, {min(days)}..{max(days)} (fields: id, date, "
                  "title, text)", highlight=False, soft_wrap=True)


@learning_options
def learn(cfg: RunConfig, evaluation: Optional[EvalConfig], source: str, start: Optional[str], end: Optional[str],
          workdir: Path, tracking_uri: Optional[str], wait: bool, as_json: bool,
          policy: str = typer.Option("monim-amt", "--policy", help=f"What learns: {catalogue.help_text()}"),
          relearn: Optional[list[str]] = typer.Option(None, "--relearn", metavar="YYYY-MM-DD", help="Learn this day "
                                                      "again (repeatable): the memory's last day, or a day it forgot "
                                                      "after it; a forgotten day is otherwise never learned again.")
          ) -> None:
    """Learn the stream's days from START to END into the work directory with one policy (then
    run the evaluation suite on it if asked); days learned or forgotten are not learned again."""
    from monim.storage.workdirs import memory_root, memory_status

    relearn = [option_date(d).isoformat() for d in relearn or []]
    plans = check_plans(cfg, start, end, [cfg.policy], relearn)
    preflight(cfg, [cfg.policy], lm=False)
    if (said := nothing_new(cfg, plans, evaluation, workdir, tracking_uri, wait)) is not None:
        rows = said[cfg.policy]
    else:
        preflight(cfg, [cfg.policy])
        from tracking.store import tracking_uri as resolve

        with said_when_full(cfg, start, end, relearn, resolve(str(workdir), tracking_uri)):
            use_workdir(workdir)
            use_tracking(workdir, tracking_uri)
            from flows.stream import learn_stream

            with refused_plans():
                rows = learn_stream(cfg, start, end, tracking_uri=tracking_uri, evaluation=evaluation, wait=wait,
                                    relearn=relearn)
    console.print(table(f"{cfg.name} on {source}", rows, ["date", "tokens_seen", "entries_stored", "memrate_day",
                                                            "entries", "ppl_lm", "ppl", "accuracy"]))
    root = memory_root(cfg.workdir, cfg.name)  # the bare LM and a parametric learner keep no memory
    emit((memory_status(root) if (root / "manifest.json").exists() else {}) | {"policy": cfg.name, "rows": rows},
         as_json)


@learning_options
def compare(cfg: RunConfig, evaluation: Optional[EvalConfig], source: str, start: Optional[str], end: Optional[str],
            workdir: Path, tracking_uri: Optional[str], wait: bool, as_json: bool,
            policies: str = typer.Option(",".join(catalogue.COMPARED), "--policies", help=f"Comma-separated runs: {catalogue.help_text()}")) -> None:
    """Run several policies over the same days into one MLflow experiment, evaluate, and report."""
    names = policies.split(",")
    for policy in names:
        with clear_errors(ValueError):
            cfg.model_validate(cfg.model_dump() | {"policy": policy})
    plans = check_plans(cfg, start, end, names)
    preflight(cfg, names, lm=False)
    if (said := nothing_new(cfg, plans, evaluation, workdir, tracking_uri, wait, comparison=True)) is not None:
        from monim.evaluation.totals import summarize

        summary = {policy: summarize(rows) for policy, rows in said.items()}
    else:
        preflight(cfg, names)
        use_workdir(workdir)
        use_tracking(workdir, tracking_uri)
        from flows.compare import compare_policies

        with refused_plans():
            summary = compare_policies(cfg, start, end, names, tracking_uri=tracking_uri, evaluation=evaluation, wait=wait)
    print_summary(f"policies on {source}", summary)
    console.print(f"report: {workdir / 'report' / 'report.md'}")
    emit({"policies": summary, "report": str(workdir / "report" / "report.md")}, as_json)


def started(server, *args) -> Popen:
    """A server from `servers.local`, or a clean exit saying why it did not start."""
    try:
        return server(*args)
    except RuntimeError as e:
        raise fail(str(e))


def serve(source: str = typer.Option(..., "--source", help="The news feed the daily run reads (a file or folder)."),
          workdir: Path = WORKDIR, policy: str = typer.Option("monim-amt", "--policy", help="What learns."),
          cron: str = typer.Option("30 2 * * *", "--cron", help="When the daily run starts (a cron line)."),
          timezone: str = typer.Option("UTC", "--timezone", help="The cron's timezone (an IANA name), and the one "
                                       "'yesterday' is counted in."),
          model: Optional[str] = MODEL,
          cluster: Optional[str] = typer.Option(None, "--cluster", help="A Dask scheduler's address: the LM pass and the "
                                                "memory's searches run on its workers."),
          part_bytes: Optional[int] = typer.Option(None, "--part-bytes", help="The most bytes of index one part of the "
                                                   "memory holds (one worker's budget); empty: one index."),
          max_feed_lag: int = typer.Option(1, "--max-feed-lag", help="The daily run fails (the feed has stalled) when "
                                           "the feed's last article is more than this many days before yesterday."),
          prefect_port: int = typer.Option(4200, "--prefect-port", help="Port of the Prefect server started when none "
                                           "is configured.")) -> None:
    """Serve the daily (cron, learns yesterday) and backfill deployments from this process.

    Without PREFECT_API_URL a Prefect server is started on 127.0.0.1 for the work directory
    (Prefect's temporary server does not run schedules); Ctrl-C stops both.
    """
    from cli.settings import config_from_options

    cfg = config_from_options(policy, source=source, workdir=workdir.resolve(), model=model, cluster=cluster,
                              part_bytes=part_bytes, max_feed_lag=max_feed_lag)
    prefect_home(workdir)
    procs: list[Popen] = []
    if "PREFECT_API_URL" not in os.environ:  # set before Prefect is imported, else it starts a temporary API of its own
        port = local.free_port(prefect_port)
        procs.append(started(local.prefect_server, port))
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        console.print(f"Prefect server and UI: http://127.0.0.1:{port}")
    use_workdir(workdir, api=False)
    try:
        from prefect import serve as prefect_serve
        from prefect.schedules import Cron

        from flows.stream import learn_stream, learn_yesterday

        params = {"run": cfg.model_dump()}
        prefect_serve(  # to_deployment is sync here (Prefect types it sync or async)
            learn_yesterday.to_deployment(name="daily", schedule=Cron(cron, timezone=timezone),
                                          parameters=params | {"timezone": timezone}),  # type: ignore[arg-type]
            learn_stream.to_deployment(name="backfill", parameters=params),  # type: ignore[arg-type]
        )
    finally:
        local.stop(procs)


def print_links(workdir: Path, mlflow_url: str, prefect_url: str) -> None:
    from tracking.runs import ui_links
    from tracking.store import tracking_uri

    console.print(f"Prefect UI: {prefect_url}\nMLflow UI:  {mlflow_url}")
    for what, url in ui_links(tracking_uri(str(workdir)), mlflow_url, prefect_url):
        console.print(f"  {what}: {url}", highlight=False, soft_wrap=True)


def print_next_steps(workdir: Path) -> None:
    """How to use the up-to-date model: generate with sources, serve its champion, query it."""
    console.print(
        "\nAsk the up-to-date model (MoNIM-AMT's memory):\n"
        f"  monim generate --workdir {workdir} --prompt 'The Bank of Japan said' --sources\n"
        "Serve its champion version over HTTP (Ctrl-C stops it), and query it once /ping answers:\n"
        f"  monim serve-model --workdir {workdir} --port 5001\n"
        "  curl -sS http://127.0.0.1:5001/invocations -H 'Content-Type: application/json' "
        "-d '{\"dataframe_records\": [{\"prompt\": \"The Bank of Japan said\"}], \"params\": {\"max_new_tokens\": 20}}'",
        highlight=False, soft_wrap=True)
