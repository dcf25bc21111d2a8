"""One streaming day: the library's recipe (monim.run.Run.day: ingest → LM features → learn (memorize
and calibrate, or train) → evaluate → register → record) with each stage a Prefect task, the day
registered in MLflow's Model Registry and logged to its MLflow run where the stream is tracked."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from flows.cluster import featurize_day
from monim.core.config import RunConfig
from monim.data.stream import Day
from monim.run import LearnerRun, MemoryRun, Run, Stages, open_run
from monim.theta.memory import Memory
from tasks import learning
from tasks.evaluation import evaluate
from tasks.feed import say_late, say_skipped
from tasks.gate import register_day
from tasks.tracking.runs import log_day


class AsTasks(Stages):
    """Each stage of a run's day as a Prefect task (retries, progress and logs in the run's view)."""

    def __init__(self, run_id: str | None, uri: str | None):
        self.run_id, self.uri = run_id, uri
        self.registry = self.register_theta if run_id else None  # a day is registered where its stream is tracked

    def ingest(self, run: Run, date: str, since: str | None) -> Day:
        day = learning.ingest(run, date, since)
        say_late(self.run_id, self.uri, date, day.late, "out of date order in the feed")
        say_skipped(date, day)
        return day

    def featurize(self, run: Run, day: Day) -> dict:
        return featurize_day(run, day)

    def memorize(self, run: MemoryRun, day: Day) -> dict:
        return learning.memorize(run, day)

    def calibrate(self, run: MemoryRun, day: Day) -> dict:
        return learning.calibrate(run, day)

    def train(self, run: LearnerRun, day: Day, index: int) -> dict:
        return learning.train(run, day, index)

    def evaluate(self, run: Run, day: Day) -> dict:
        return evaluate(run, day)

    def register_theta(self, cfg: RunConfig, theta: Memory, day: Day) -> dict:
        return register_day(cfg, day, theta, self.run_id, self.uri)

    def record(self, run: Run, row: dict) -> None:
        if self.run_id:
            log_day(self.run_id, self.uri, row["step"], row)
        learning.record_day(run, row)


def _run_name() -> str:
    params = flow_run.parameters
    return f"{RunConfig.model_validate(params['cfg']).name}-{params['date']}"


@flow(name="monim-day", flow_run_name=_run_name)
def learn_day(cfg: RunConfig, date: str, run_id: str | None = None, tracking_uri: str | None = None, step: int = 0,
              since: str | None = None) -> dict:
    """Learn one day of news into the run (its memory or its weights), evaluate it, and log the day's metrics.

    `since`: the first day whose records it counts (monim.storage.plan.Plan.since)."""
    row = open_run(cfg).day(date, step, since, AsTasks(run_id, tracking_uri))
    create_table_artifact([{"metric": k, "value": v} for k, v in row.items()], key=f"monim-{cfg.name.replace('+', '-')}-day",
                          description=f"{cfg.name}, {date}")
    return row
