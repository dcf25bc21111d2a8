"""The evaluation suite over learned runs: per-period PPL (the forgetting matrix), the forgetting
probe on general-domain text, and multiple-choice QA, each logged to the runs in MLflow."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict

from prefect import flow

from flows.stream import experiment_name
from monim.config import RunConfig
from monim.evaluate import EvalConfig
from tasks.evaluation import checkpoint_days, period_perplexity, question_answering, text_perplexity
from tasks.learning import recorded_days
from tasks.tracking import log_points, open_run, tracking_uri as resolve_tracking_uri


def _learned(configs: list[dict], start: str | None, end: str | None) -> list[str]:
    """The days every run has learned, from start to end."""
    days = set.intersection(*(set(recorded_days(c)) for c in configs))
    return sorted(d for d in days if (start is None or d >= start) and (end is None or d <= end))


@flow(name="monim-evaluate")
def evaluate_runs(configs: list[dict], start: str | None = None, end: str | None = None,
                  evaluation: dict | None = None, experiment: str | None = None,
                  tracking_uri: str | None = None) -> dict:
    """Measure learned runs as of past days (time travel) and log each measure to its MLflow run
    at step = day index: `ppl_period/<period>` and `accuracy_period/<period>`, `ppl_text` and
    `ppl_text_lm`, `qa_accuracy_<k>shot` with its 95% interval and `qa_n`."""
    e = EvalConfig(**(evaluation or {}))
    days = _learned(configs, start, end)
    if not days:
        return {}
    source, workdir = configs[0]["source"], configs[0]["workdir"]
    origin = dt.date.fromisoformat(min(d for c in configs for d in recorded_days(c)))

    def step(day: str) -> int:
        return (dt.date.fromisoformat(day) - origin).days

    at = checkpoint_days(days, e)
    ecfg = asdict(e)
    points: dict[str, list] = {RunConfig(**c).name: [] for c in configs}
    out = {}
    if e.period:
        out["periods"] = period_perplexity(configs, source, days[0], days[-1], at["periods"], ecfg)
        for period, runs in out["periods"].items():
            for name, cells in runs.items():
                points[name] += [(f"{m}_period/{period}", step(d), r[m]) for d, r in cells.items() for m in ("ppl", "accuracy")]
    if e.text:
        out["text"] = text_perplexity(configs, at["text"], ecfg)
        for name, cells in out["text"].items():
            points[name] += [(k, step(d), r[src]) for d, r in cells.items() for k, src in (("ppl_text", "ppl"), ("ppl_text_lm", "ppl_lm"))]
    if e.qa:
        out["qa"] = question_answering(configs, days[0], days[-1], ecfg)
        for name, by_shots in out["qa"].items():
            points[name] += [(f"{m}_{k}shot" if m != "qa_n" else m, step(days[-1]), v)
                             for k, r in by_shots.items() for m, v in r.items()]
    uri = resolve_tracking_uri(workdir, tracking_uri)
    for config in configs:
        run_id = open_run(config, experiment or experiment_name(source), uri, origin.isoformat())
        log_points(run_id, uri, points[RunConfig(**config).name])
    return out
