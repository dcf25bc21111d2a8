"""A stream of days in date order, resuming after the last finished day; and the daily flow, which
fails when its feed has stalled."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

from prefect import flow

from flows.day import learn_day
from flows.evaluate import evaluate_runs
from monim.config import RunConfig
from monim.suite import EvalConfig
from monim.lock import hold
from monim.stream import FeedStalled, check_feed, list_dates
from tasks.feed import arrived_late, thin_day
from tasks.learning import recorded_days, run_for, run_lock
from tasks.logs import logger
from tasks.store import experiment_name, tracking_uri as resolve_tracking_uri
from tasks.tracking import describe, ended, log_summary, open_run, step_of


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
    `wait` is False. Before the first day, the articles the last learned day got since it was learned are
    named (tasks.feed.arrived_late: not learned); a thin day is a warning and a tag (tasks.feed.thin_day).
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
            learned = sorted(done.values(), key=lambda r: r["date"])
            if todo and learned and learned[-1]["date"] < todo[0]:
                arrived_late(run, learned[-1], run_id, uri)
            for date in todo:
                learned.append(learn_day(run, date, run_id, uri, step=step_of(origin, date)))
                thin_day(run_id, uri, learned[-1], learned)
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
    with `evaluation`, the suite measures the days not measured yet.

    A feed whose last article is more than `run.max_feed_lag` days before yesterday has stalled: the days
    it has are learned, then the run fails (FeedStalled, its message naming the feed's last date), so
    that Prefect's automations and notifications act on it."""
    yesterday = dt.datetime.now(ZoneInfo(timezone)).date() - dt.timedelta(days=1)
    done = recorded_days(run)
    start = dt.date.fromisoformat(max(done)) + dt.timedelta(days=1) if done else yesterday
    rows = []
    if start > yesterday:
        logger().info("nothing to learn: %s is already learned", yesterday)
    else:
        rows = learn_stream(run, start.isoformat(), yesterday.isoformat(), experiment, tracking_uri, evaluation, wait)
    try:
        check_feed(run.source, yesterday, run.max_feed_lag, run.on_error, run.fields())
    except FeedStalled as e:
        logger().warning("%s", e)
        raise
    return rows
