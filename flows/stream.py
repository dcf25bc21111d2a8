"""A stream of days in date order, resuming after the last finished day; and the daily flow."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict
from zoneinfo import ZoneInfo

from prefect import flow

from flows.day import learn_day
from flows.evaluate import evaluate_runs
from monim.config import RunConfig
from monim.stream import list_dates
from tasks.learning import logger, recorded_days
from tasks.tracking import experiment_name, log_summary, open_run, tracking_uri as resolve_tracking_uri


def _date(value: str | dt.date | None) -> dt.date | None:
    return dt.date.fromisoformat(value) if isinstance(value, str) else value


def stream_config(source: str, policy: str, workdir: str, model: str | None, max_docs: int | None,
                  policy_params: dict | None, seed: int, calibrated: bool, calibrator_params: dict | None,
                  feature_store: bool = True) -> dict:
    """The RunConfig (as a dict) of one policy learning a stream."""
    return asdict(RunConfig(source=source, workdir=workdir, policy=policy, policy_params=policy_params or {},
                            model=model, max_docs=max_docs, seed=seed, calibrated=calibrated,
                            calibrator_params=calibrator_params or {}, feature_store=feature_store))


@flow(name="monim-stream")
def learn_stream(source: str, start: str | None = None, end: str | None = None, policy: str = "monim-amt",
                 workdir: str = "monim-work", model: str | None = None, max_docs: int | None = None,
                 policy_params: dict | None = None, seed: int = 0, experiment: str | None = None,
                 tracking_uri: str | None = None, calibrated: bool = True,
                 calibrator_params: dict | None = None, evaluation: dict | None = None,
                 feature_store: bool = True) -> list[dict]:
    """Learn every day from start to end with one policy; days already finished are skipped.

    Θ uses the NN calibrator's λ unless `calibrated` is False (constant λ; run named '<policy>-const').
    `evaluation` (monim.evaluate.EvalConfig fields) runs the evaluation suite on the run afterwards.
    `feature_store`: keep the LM's features in the work directory for other policies and re-runs
    (off: the LM runs in each task and nothing is kept).
    """
    config = stream_config(source, policy, workdir, model, max_docs, policy_params, seed, calibrated, calibrator_params,
                           feature_store)
    cfg = RunConfig(**config)
    done = recorded_days(config)
    dates = [d.isoformat() for d in list_dates(source, _date(start), _date(end))]
    todo = [d for d in dates if d not in done]
    logger().info("%s: %d days in range, %d already learned, %d to learn", cfg.name, len(dates), len(dates) - len(todo), len(todo))
    uri = resolve_tracking_uri(workdir, tracking_uri)
    origin = dt.date.fromisoformat(min([*done, *dates] or ["9999-12-31"]))
    run_id = open_run(config, experiment or experiment_name(source), uri, origin.isoformat())
    for date in todo:
        learn_day(config, date, run_id, uri, step=(dt.date.fromisoformat(date) - origin).days)
    rows = sorted(recorded_days(config).values(), key=lambda r: r["date"])
    if todo:
        log_summary(run_id, uri, rows)
    if evaluation:
        evaluate_runs([config], start, end, evaluation, experiment, tracking_uri)
    return [r for r in rows if r["date"] in dates]


@flow(name="monim-yesterday")
def learn_yesterday(source: str, workdir: str = "monim-work", policy: str = "monim-amt", timezone: str = "UTC",
                    model: str | None = None, max_docs: int | None = None, experiment: str | None = None,
                    tracking_uri: str | None = None, evaluation: dict | None = None) -> list[dict]:
    """The daily job: learn yesterday (in `timezone`), catching up any day missed since the last run;
    with `evaluation`, the suite measures the days not measured yet."""
    yesterday = dt.datetime.now(ZoneInfo(timezone)).date() - dt.timedelta(days=1)
    done = recorded_days(asdict(RunConfig(source=source, workdir=workdir, policy=policy)))
    start = dt.date.fromisoformat(max(done)) + dt.timedelta(days=1) if done else yesterday
    if start > yesterday:
        logger().info("nothing to learn: %s is already learned", yesterday)
        return []
    return learn_stream(source, start.isoformat(), yesterday.isoformat(), policy, workdir, model, max_docs,
                        experiment=experiment, tracking_uri=tracking_uri, evaluation=evaluation)
