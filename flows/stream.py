"""A stream of days in date order, resuming after the last finished day; and the daily flow."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

from prefect import flow

from flows.day import learn_day
from flows.evaluate import evaluate_runs
from monim.config import RunConfig
from monim.suite import EvalConfig
from monim.lock import hold
from monim.stream import list_dates
from tasks.learning import logger, recorded_days, run_lock
from tasks.runs import run_for
from tasks.tracking import describe, ended, experiment_name, log_summary, open_run, step_of, tracking_uri as resolve_tracking_uri


def _date(value: str | dt.date | None) -> dt.date | None:
    return dt.date.fromisoformat(value) if isinstance(value, str) else value


@flow(name="monim-stream")
def learn_stream(run: RunConfig, start: str | None = None, end: str | None = None, experiment: str | None = None,
                 tracking_uri: str | None = None, evaluation: EvalConfig | None = None, wait: bool = True,
                 comparison: str | None = None) -> list[dict]:
    """Learn every day of `run.source` from start to end with `run.policy`; days already finished are skipped.

    The MLflow run is named after its policy ('<policy>-const' when Θ uses the constant λ), reopened
    while this invocation learns and ended with it (FINISHED, FAILED or KILLED); `comparison` is the run of
    a comparison it belongs to. `evaluation` runs the evaluation suite on the run afterwards. While
    another process learns the same run, this one waits (saying who holds it), or fails at once when
    `wait` is False.
    """
    with hold(run_lock(run), wait, say=logger().warning):
        done = recorded_days(run)
        dates = [d.isoformat() for d in list_dates(run.source, _date(start), _date(end), run.on_error, run.fields())]
        todo = [d for d in dates if d not in done]
        if todo:
            run_for(run).open()  # another model, weights or settings, or a damaged memory: refused before any work
        logger().info("%s: %d days in range, %d already learned, %d to learn", run.name, len(dates), len(dates) - len(todo), len(todo))
        uri = resolve_tracking_uri(run.workdir, tracking_uri)
        run_id, origin = open_run(run, experiment or experiment_name(run.source), uri, comparison)
        with ended(run_id, uri, lambda: describe(run)):
            for date in todo:
                learn_day(run, date, run_id, uri, step=step_of(origin, date))
            rows = sorted(recorded_days(run).values(), key=lambda r: r["date"])
            if todo:
                log_summary(run_id, uri, rows)
    if evaluation:
        evaluate_runs([run], start, end, evaluation, experiment, tracking_uri)
    return [r for r in rows if r["date"] in dates]


@flow(name="monim-yesterday")
def learn_yesterday(run: RunConfig, timezone: str = "UTC", experiment: str | None = None,
                    tracking_uri: str | None = None, evaluation: EvalConfig | None = None, wait: bool = True) -> list[dict]:
    """The daily job: learn yesterday (in `timezone`), catching up any day missed since the last run;
    with `evaluation`, the suite measures the days not measured yet."""
    yesterday = dt.datetime.now(ZoneInfo(timezone)).date() - dt.timedelta(days=1)
    done = recorded_days(run)
    start = dt.date.fromisoformat(max(done)) + dt.timedelta(days=1) if done else yesterday
    if start > yesterday:
        logger().info("nothing to learn: %s is already learned", yesterday)
        return []
    return learn_stream(run, start.isoformat(), yesterday.isoformat(), experiment, tracking_uri, evaluation, wait)
