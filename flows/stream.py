"""A stream of days in date order, resuming after the last finished day; and the daily flow, which
fails when its feed has stalled."""

from __future__ import annotations

import datetime as dt
from typing import cast
from zoneinfo import ZoneInfo

from prefect import flow

from flows.day import learn_day
from flows.evaluate import evaluate_runs
from monim.core.config import EvalConfig
from monim.core.lock import hold
from monim.core.run_config import RunConfig
from monim.data.stream import FeedStalled, check_feed
from monim.plan import Plan, last_read, plan
from monim.run import MemoryRun, open_run, recorded_days
from monim.storage import workdirs
from tasks.feed import arrived_late, thin_day
from tasks.logs import logger
from tracking.logged import step_of
from tracking.runs import describe, ended, experiment_name, log_summary, mlflow_run
from tracking.store import tracking_uri as resolve_tracking_uri


def as_date(value: str | None) -> dt.date | None:
    """A date of the flow's parameters (a string, as Prefect and deployments pass it) as the library takes it."""
    return dt.date.fromisoformat(value) if value else None


@flow(name="monim-stream")
def learn_stream(run: RunConfig, start: str | None = None, end: str | None = None, experiment: str | None = None,
                 tracking_uri: str | None = None, evaluation: EvalConfig | None = None, wait: bool = True,
                 comparison: str | None = None, relearn: list[str] | None = None) -> list[dict]:
    """Learn every day of `run.source` from start to end with `run.policy`; days already finished are
    skipped, and days its memory forgot are never learned again unless named in `relearn`.

    The range is read and checked before any work (monim.plan: a missing feed, a reversed or empty range, a
    day before the memory's last, a bad record or an id the memory read on another day is refused; the
    feed's read is shared by every policy of a comparison). The MLflow run is
    named after its policy ('<policy>-const' when Θ uses the constant λ), reopened while this invocation
    learns and ended with it (FINISHED, FAILED or KILLED); `comparison` is the run of a comparison it
    belongs to. `evaluation` runs the evaluation suite on the run afterwards. While another process
    learns the same run, this one waits (saying who holds it), or fails at once when `wait` is False.
    Every learned day this run reads again, and the last one before its first new day, has the articles
    it got since it was learned named (tasks.feed.arrived_late: not learned); a thin day is a warning
    and a tag (tasks.feed.thin_day).
    """
    with hold(workdirs.run_lock(run.workdir, run.name), wait, say=logger().warning):
        todo = plan(run, as_date(start), as_date(end), [dt.date.fromisoformat(d) for d in relearn or []])
        if todo.todo:
            open_run(run).open()  # another model, weights or settings, or a damaged memory: refused before any work
        for date in todo.relearn:  # days a memory forgot: only a memory's run has them
            cast(MemoryRun, open_run(run)).relearn(date)
        say_plan(run, todo)
        uri = resolve_tracking_uri(run.workdir, tracking_uri)
        run_id, origin = mlflow_run(run, experiment or experiment_name(run.source), uri, comparison)
        with ended(run_id, uri, lambda: describe(run)):
            learned = sorted(recorded_days(run).values(), key=lambda r: r["date"])
            for row in learned:  # the learned days the plan read again: what they got since
                if (seen := dt.date.fromisoformat(row["date"])) in todo.seen:
                    arrived_late(run, row, run_id, uri, todo.arrived.get(seen, []))
            before = [r for r in learned if todo.todo and r["date"] < todo.todo[0].isoformat()]
            if before and (last := dt.date.fromisoformat(before[-1]["date"])) not in todo.seen:  # a resume: read for it
                arrived_late(run, before[-1], run_id, uri, since=todo.since(last))
            for date in todo.todo:
                day = date.isoformat()  # Prefect's parameter
                learned.append(learn_day(run, day, run_id, uri, step=step_of(origin, day),
                                         since=todo.since(date).isoformat()))
                thin_day(run_id, uri, learned[-1], learned)
            rows = sorted(recorded_days(run).values(), key=lambda r: r["date"])
            if todo.todo:
                log_summary(run_id, uri, rows)
    if evaluation:
        evaluate_runs([run], start, end, evaluation, experiment, tracking_uri)
    return [r for r in rows if dt.date.fromisoformat(r["date"]) in todo.dates]


def say_plan(cfg: RunConfig, todo: Plan) -> None:
    """The range in the run's log: its days, those learned, forgotten and left to learn."""
    for level, message in todo.said(cfg.name):
        logger().log(level, "%s", message)


@flow(name="monim-yesterday")
def learn_yesterday(run: RunConfig, timezone: str = "UTC", experiment: str | None = None,
                    tracking_uri: str | None = None, evaluation: EvalConfig | None = None, wait: bool = True) -> list[dict]:
    """The daily job: learn yesterday (in `timezone`), catching up any day missed since the last run;
    with `evaluation`, the suite measures the days not measured yet.

    A feed whose last article is more than `run.max_feed_lag` days before yesterday has stalled: the days
    it has are learned, then the run fails (FeedStalled, its message naming the feed's last date), so
    that Prefect's automations and notifications act on it."""
    yesterday = dt.datetime.now(ZoneInfo(timezone)).date() - dt.timedelta(days=1)
    last = last_read(run)  # learned, or forgotten: never learned again
    start = last + dt.timedelta(days=1) if last else yesterday
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
