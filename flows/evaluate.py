"""The evaluation suite over learned runs: per-period PPL (the forgetting matrix), the forgetting
probe on general-domain text, and multiple-choice QA, each logged to the runs in MLflow."""

from __future__ import annotations

import datetime as dt
import functools
from contextlib import ExitStack
from typing import Callable

from prefect import flow

from monim.core.config import EvalConfig, period_of
from monim.core.run_config import RunConfig
from monim.run import open_run, recorded_days
from tasks.cluster import searching_on_cluster
from tasks.evaluation import period_perplexity, question_answering, text_perplexity
from tracking.logged import step_of
from tracking.runs import describe, ended, experiment_name, log_points, metric_steps, mlflow_run
from tracking.store import tracking_uri as resolve_tracking_uri


def _learned(configs: list[RunConfig], start: str | None, end: str | None) -> list[str]:
    """The days every run has learned, from start to end."""
    days = set.intersection(*(set(recorded_days(c)) for c in configs))
    return sorted(d for d in days if (start is None or d >= start) and (end is None or d <= end))


@flow(name="monim-evaluate")
def evaluate_runs(configs: list[RunConfig], start: str | None = None, end: str | None = None,
                  evaluation: EvalConfig | None = None, experiment: str | None = None,
                  tracking_uri: str | None = None) -> dict:
    """Measure learned runs as of past days (time travel) and log each measure to its MLflow run
    at step = day index: `ppl_period/<period>` and `accuracy_period/<period>`, `ppl_text` and
    `ppl_text_lm`, `qa_accuracy_<k>shot` with its 95% interval and `qa_n`. Measures already
    logged for a run and day are not taken again: a daily run measures only its new days, a run
    added to an experiment only itself."""
    e = evaluation or EvalConfig()
    days = _learned(configs, start, end)
    if not days:
        return {}
    source, workdir = configs[0].source, configs[0].workdir
    uri = resolve_tracking_uri(workdir, tracking_uri)
    opened = {c.name: mlflow_run(c, experiment or experiment_name(source), uri) for c in configs}
    with ExitStack() as stack:  # each run ended with this invocation; its memory searched on its cluster's workers
        for c in configs:
            stack.enter_context(ended(opened[c.name][0], uri, functools.partial(describe, c)))
            stack.enter_context(searching_on_cluster(open_run(c)))
        return _measure(configs, days, e, uri, opened)


def _measure(configs: list[RunConfig], days: list[str], e: EvalConfig, uri: str, opened: dict[str, tuple[str, str]]) -> dict:
    """The suite's measures each run lacks, logged to its run (run name -> (run id, origin) in `opened`)."""
    source = configs[0].source
    run_ids = {name: run_id for name, (run_id, _) in opened.items()}
    origins = {name: origin for name, (_, origin) in opened.items()}

    def missing(candidates: list[str], key: Callable[[str], str]) -> tuple[list[str], list[RunConfig]]:
        """The days some run has not measured yet, and those runs (logged measures are not retaken)."""
        keys = sorted({key(d) for d in candidates})
        logged = {name: metric_steps(run_id, uri, keys) for name, run_id in run_ids.items()}
        lacking = {name: [d for d in candidates if step_of(origins[name], d) not in logged[name].get(key(d), [])]
                   for name in logged}
        return sorted({d for ds in lacking.values() for d in ds}), [c for c in configs if lacking[c.name]]

    at = e.checkpoints(days)
    points: dict[str, list] = {name: [] for name in run_ids}
    out = {}
    period = e.period or ""  # "": no period asked for
    if period and (todo := missing(at["periods"], lambda d: f"ppl_period/{period_of(dt.date.fromisoformat(d), period)}"))[0]:
        out["periods"] = period_perplexity(todo[1], source, days[0], days[-1], todo[0], e)
        for period, runs in out["periods"].items():
            for name, cells in runs.items():
                points[name] += [(f"{m}_period/{period}", step_of(origins[name], d), r[m]) for d, r in cells.items()
                                 for m in ("ppl", "accuracy")]
    if e.text and (todo := missing(at["text"], lambda d: "ppl_text"))[0]:
        out["text"] = text_perplexity(todo[1], todo[0], e)
        for name, cells in out["text"].items():
            points[name] += [(k, step_of(origins[name], d), r[src]) for d, r in cells.items()
                             for k, src in (("ppl_text", "ppl"), ("ppl_text_lm", "ppl_lm"))]
    if e.qa and (todo := missing(at["qa"], lambda d: f"qa_accuracy_{e.shots[-1]}shot"))[0]:
        out["qa"] = question_answering(todo[1], days[0], days[-1], e)
        for name, by_shots in out["qa"].items():
            points[name] += [(f"{m}_{k}shot" if m != "qa_n" else m, step_of(origins[name], days[-1]), v)
                             for k, r in by_shots.items() for m, v in r.items()]
    for name, run_id in run_ids.items():
        log_points(run_id, uri, points[name])
    return out
