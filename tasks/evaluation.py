"""Evaluation tasks: a day's test articles with the run as of the day; and the evaluation suite
(monim.evaluation.suite): per-period PPL as of each period's end, the forgetting probe, QA, over many runs at once.

Each task evaluates every memory at once (read as of past days, without copies), so the frozen LM
scores each text once; a parametric learner's weights of each day score it on their own. Results
are cached on the runs' states and the suite's settings.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from typing import Iterator

from prefect import task

from monim.core.config import EvalConfig, period_of
from monim.core.run_config import RunConfig
from monim.data.day import Day
from monim.evaluation.suite import (
    View,
    period_results,
    period_sets,
    qa_results,
    text_document,
    text_results,
)
from monim.lm.model import resolved_dtype
from monim.run import Run, open_run
from tasks.cluster import stage
from tasks.logs import logger


def _evaluation_key(context, parameters: dict) -> str:
    """Cache key: the day, the run's settings (the LM's dtype as "auto" resolves on this machine) and
    the state of what the run predicts with as of the day, read from its manifest (no model loaded)."""
    run, date = parameters["run"], parameters["day"].date.isoformat()
    return f"monim-eval-{run.cfg.fingerprint()}-{resolved_dtype(run.cfg.dtype)}-{date}-{run.state(date)}"


@task(cache_key_fn=_evaluation_key, persist_result=True)
def evaluate(run: Run, day: Day) -> dict:
    """Test PPL and next-word accuracy of the LM alone and of the run as of the day, on the day's test articles."""
    started = time.perf_counter()
    with stage("evaluation search"):
        metrics = run.evaluate(day)
    logger().info("%s %s: test PPL %.2f (LM alone %.2f), accuracy %.3f", run.cfg.name, day.date, metrics["ppl"],
                  metrics["ppl_lm"], metrics["accuracy"])
    return metrics | {"evaluate_seconds": time.perf_counter() - started}


def _views(configs: list[RunConfig], days: list[str], e: EvalConfig) -> Iterator[View]:
    """Who scores what: the frozen LM once for every run that reads it (each memory as of each day,
    under the suite's recency rule; None: the bare LM); then each parametric run's weights as of
    each day, loaded one at a time."""
    runs = [open_run(cfg) for cfg in configs]
    frozen = {(run.cfg.name, day): run.predictor(day, e.recency)[2] for run in runs if run.frozen for day in days}
    if frozen:
        lm, features, _ = next(run for run in runs if run.frozen).predictor(None)
        yield lm, features, frozen
    for run in (r for r in runs if not r.frozen):
        for day in days:
            lm, features, _ = run.predictor(day)
            yield lm, features, {(run.cfg.name, day): None}


def _suite_key(context, parameters: dict) -> str:
    """Cache key: each run's settings and state (what it predicts with now), the days and the suite's settings."""
    states = [f"{cfg.fingerprint()}:{open_run(cfg).state()}" for cfg in parameters["configs"]]
    rest = {k: v for k, v in parameters.items() if k != "configs"}
    # hashed: the key names a file, and seven runs' states with the suite's settings pass 255 characters
    key = json.dumps([states, rest], sort_keys=True, default=str)
    return f"monim-{context.task.name}-{hashlib.sha256(key.encode()).hexdigest()[:32]}"


def _asked(e: EvalConfig, name: str) -> str:
    """A measure's setting, which the flow sets whenever it asks for the measure."""
    value = getattr(e, name)
    if value is None:
        raise ValueError(f"evaluation.{name} is not set: the measure that reads it was not asked for")
    return value


def _cells(results: dict) -> dict[str, dict[str, dict]]:
    """{(run, day): metrics} as {run: {day: metrics}}."""
    out: dict[str, dict[str, dict]] = {}
    for (name, day), metrics in results.items():
        out.setdefault(name, {})[day] = metrics
    return out


@task(cache_key_fn=_suite_key, persist_result=True)
def period_perplexity(configs: list[RunConfig], source: str, start: str, end: str, days: list[str], e: EvalConfig) -> dict:
    """PPL and next-word accuracy on each period's test articles, with each run's memory as of the
    end of that period and of every later one (the lower triangle of the forgetting matrix)."""
    cfg = configs[0]
    period = _asked(e, "period")
    sets = period_sets(source, dt.date.fromisoformat(start), dt.date.fromisoformat(end), period, cfg.seed,
                       e.period_docs, fields=cfg.fields(), on_error=cfg.on_error)
    later = lambda key, end_of: period_of(dt.date.fromisoformat(key[1]), period) >= end_of  # noqa: E731
    with stage("evaluation search"):
        out = {p: _cells(cells) for p, cells in period_results(_views(configs, days, e), sets, later).items()}
    for p, runs in out.items():
        logger().info("%s: %d test articles, PPL by run and day: %s", p, len(sets[p]),
                      {n: {d: round(r["ppl"], 2) for d, r in days_.items()} for n, days_ in runs.items()})
    return out


@task(cache_key_fn=_suite_key, persist_result=True)
def text_perplexity(configs: list[RunConfig], days: list[str], e: EvalConfig) -> dict:
    """The forgetting probe: PPL of each run on a general-domain text, as of each probe day."""
    doc = text_document(_asked(e, "text"), e.text_chars)
    with stage("evaluation search"):
        results = _cells(text_results(_views(configs, days, e), doc))
    logger().info("forgetting probe on %s: %s", doc.id, {n: {d: round(m["ppl"], 2) for d, m in r.items()} for n, r in results.items()})
    return results


@task(cache_key_fn=_suite_key, persist_result=True)
def question_answering(configs: list[RunConfig], first: str, last: str, e: EvalConfig) -> dict:
    """Multiple-choice accuracy of each run's final memory on the questions of its window
    (EvalConfig.qa_window), for each number of shots: {run: {shots: metrics}}."""
    with stage("evaluation search"):
        by_shots = qa_results(_views(configs, [last], e), _asked(e, "qa"), dt.date.fromisoformat(first),
                              dt.date.fromisoformat(last), e)
    out: dict[str, dict] = {}
    for k, cells in by_shots.items():
        for (name, _), metrics in cells.items():
            out.setdefault(name, {})[k] = metrics
        logger().info("QA %d-shot on %d questions: %s", k, next(iter(cells.values()))["qa_n"] if cells else 0,
                      {n: round(r[k]["qa_accuracy"], 3) for n, r in out.items()})
    return out
