"""One streaming day: ingest → LM features → learn (memorize and calibrate, or train) → evaluate →
register → log (the day's numbers and the run's totals so far)."""

from __future__ import annotations

import time

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from monim.config import RunConfig
from flows.cluster import featurize_day
from tasks.feed import say_late
from monim.report import so_far
from tasks.learning import ingest, record_day, recorded_days, run_for
from tasks.runs import evaluate, learn, register
from tasks.tracking import log_day


def _run_name() -> str:
    params = flow_run.parameters
    return f"{RunConfig.model_validate(params['cfg']).name}-{params['date']}"


@flow(name="monim-day", flow_run_name=_run_name)
def learn_day(cfg: RunConfig, date: str, run_id: str | None = None, tracking_uri: str | None = None, step: int = 0,
              since: str | None = None) -> dict:
    """Learn one day of news into the run (its memory or its weights), evaluate it, and log the day's metrics.

    The day is read once and handed to every task; `since`: the first day whose records it counts
    (monim.plan.Plan.since)."""
    run = run_for(cfg)
    day = ingest(cfg, date, since)
    say_late(run_id, tracking_uri, date, day.late, "out of date order in the feed")
    row = {"date": date, "policy": cfg.name, "step": step} | {f"docs_{k}": v for k, v in day.counts().items()}
    lm_pass = featurize_day(cfg, day, run.splits)
    started = time.perf_counter()  # the day's cost beyond the LM's pass (one per token, shared by every policy)
    row |= {"tokens_featurized": lm_pass["tokens"], "seconds_featurize": lm_pass["seconds"],
            "featurize_workers": lm_pass.get("workers", 1)}
    with run.writing():  # learned, evaluated and recorded as one: a forget waits for the whole day
        row |= learn(cfg, day, step)
        row["seconds_learn"] = time.perf_counter() - started
        row |= evaluate(cfg, date, run.state(date), day)  # as of the day, even when re-run later
        row |= so_far([r for d, r in sorted(recorded_days(cfg).items()) if d < date] + [row])
        if run_id:
            row |= register(cfg, day, run_id, tracking_uri)
            log_day(run_id, tracking_uri, step, row)
        record_day(cfg, row)
    create_table_artifact([{"metric": k, "value": v} for k, v in row.items()], key=f"monim-{cfg.name.replace('+', '-')}-day",
                          description=f"{cfg.name}, {date}")
    return row
