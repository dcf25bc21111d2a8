"""One streaming day, the recipe as Prefect tasks: ingest → LM features → learn (memorize, which
commits the day and updates the index, then calibrate; or train) → evaluate → register → log →
record. The day, its statistics, Θ's settings and the row pass from one task to the next; Θ as of
the day is registered in MLflow's Model Registry and the row logged to its MLflow run where the
stream is tracked. With the run's cluster, the LM pass (flows.cluster) and the memory's searches
(tasks.cluster) run on its workers. monim.run.Run.day is the same sequence without Prefect or MLflow."""

from __future__ import annotations

import datetime as dt
import time

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from flows.cluster import featurize_day
from monim.core.run_config import RunConfig
from monim.run import LearnerRun, MemoryRun, open_run
from tasks.cluster import searching_on_cluster
from tasks.evaluation import evaluate
from tasks.feed import say_late, say_skipped
from tasks.gate import register_day
from tasks.learning import calibrate, ingest, memorize, record_day, train
from tracking.runs import log_day


def _run_name() -> str:
    params = flow_run.parameters
    return f"{RunConfig.model_validate(params['cfg']).name}-{params['date']}"


@flow(name="monim-day", flow_run_name=_run_name)
def learn_day(cfg: RunConfig, date: str, run_id: str | None = None, tracking_uri: str | None = None, step: int = 0,
              since: str | None = None) -> dict:
    """Learn one day of news into the run (its memory or its weights), evaluate it, and log the day's metrics.

    `step`: the day's index in the stream; `since`: the first day whose records it counts
    (monim.plan.Plan.since)."""
    run = open_run(cfg)
    day = ingest(run, dt.date.fromisoformat(date), dt.date.fromisoformat(since) if since else None)
    say_late(run_id, tracking_uri, date, day.late, "out of date order in the feed")
    say_skipped(date, day)
    lm_pass = featurize_day(run, day)
    started = time.perf_counter()  # the day's cost beyond the LM's pass (one per token, shared by every policy)
    # learned, evaluated, registered and recorded as one: a forget waits for the whole day; with a
    # cluster, the memory's searches run on its workers (the commit stays here)
    with run.writing(), searching_on_cluster(run):
        if isinstance(run, MemoryRun):
            stats = memorize(run, day)
            theta = calibrate(run, day) if run.calibrates else {}
            learned = run.learned(stats, theta)
        elif isinstance(run, LearnerRun):
            learned = run.trained(train(run, day, step))
        else:  # the bare LM learns nothing
            learned = {}
        seconds_learn = time.perf_counter() - started
        metrics = evaluate(run, day)  # as of the day, even when re-run later
        row = run.row(day, step, lm_pass, learned, seconds_learn, metrics)
        if run_id and tracking_uri and isinstance(run, MemoryRun):  # Θ is registered where its stream is tracked
            row |= register_day(cfg, day, run.memory.at(date), run_id, tracking_uri)
        if run_id and tracking_uri:
            log_day(run_id, tracking_uri, step, row)
        record_day(run, row)
    create_table_artifact([{"metric": k, "value": v} for k, v in row.items()], key=f"monim-{cfg.name.replace('+', '-')}-day",
                          description=f"{cfg.name}, {date}")
    return row
