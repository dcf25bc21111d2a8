"""The daily flow on a feed that stalls, thins out and sends news late (Prefect's test harness, MLflow
on SQLite, a tiny model); the alarms themselves are tests/test_alarms.py's."""

import datetime as dt
import json
import logging
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from mlflow.tracking import MlflowClient

from monim.core.config import DEMO_STREAM
from monim.core.run_config import RunConfig
from monim.data.feed import open_feed
from monim.data.stream import iter_days

pytestmark = pytest.mark.slow  # runs the daily flow under Prefect

REPO = Path(__file__).resolve().parents[1]


class Lines(logging.Handler):
    """The messages of the warnings logged while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def append(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def stalled(prefect, tiny_model_dir, tmp_path_factory):
    """Three days learned (16 articles each, the last 7 days ago), then the feed gets a story for that
    day, 3 articles for the next day and a record out of date order, and stops: the daily run at today."""
    from flows.stream import learn_stream, learn_yesterday

    today = dt.datetime.now(ZoneInfo("UTC")).date()
    day = lambda n: (today - dt.timedelta(days=n)).isoformat()  # noqa: E731  (n days ago)
    texts = iter(d.text for d in next(iter_days(open_feed(DEMO_STREAM))).train)  # real, distinct news
    story = lambda doc_id, date: {"id": doc_id, "date": date, "text": next(texts)}  # noqa: E731
    work = tmp_path_factory.mktemp("feed")
    feed = work / "feed.jsonl"
    append(feed, [story(f"{day(n)}-{i}", day(n)) for n in (9, 8, 7) for i in range(16)])
    run = RunConfig(source=str(feed), workdir=str(work / "w"), model=str(tiny_model_dir("llama")), policy="bare",
                    on_error="skip")
    learn_stream(run, day(9), day(7))
    append(feed, [story("wire", day(7)), *(story(f"{day(6)}-{i}", day(6)) for i in range(3)), story("older", day(8))])
    seen = Lines()
    logging.getLogger("prefect.flow_runs").addHandler(seen)
    try:
        state = learn_yesterday(run, return_state=True)
    finally:
        logging.getLogger("prefect.flow_runs").removeHandler(seen)
    return run, state, day, seen.lines


def test_a_stalled_feed_fails_the_daily_run_naming_its_last_date(stalled):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    from monim.run import recorded_days

    run, state, day, warnings = stalled
    said = f"the feed has stalled: its last article is dated {day(6)}, 5 days before {day(1)}"
    assert state.is_failed() and said in state.message and run.source in state.message
    with get_client(sync_client=True) as client:  # what Prefect's automations see
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
    assert flow_run.state.type == StateType.FAILED and said in flow_run.state.message
    assert any(said in line for line in warnings)
    assert sorted(recorded_days(run)) == [day(9), day(8), day(7), day(6)]  # the days the feed had, learned first


def test_late_news_and_a_thin_day_are_named_in_the_log_and_mlflow(stalled):
    from monim.run import recorded_days

    run, _, day, warnings = stalled
    rows = recorded_days(run)
    assert (rows[day(6)]["docs_late"], rows[day(6)]["docs_train"] + rows[day(6)]["docs_validation"]
            + rows[day(6)]["docs_test"]) == (1, 3)
    client = MlflowClient(f"sqlite:///{Path(run.workdir) / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("monim-feed").experiment_id])
    tags = mlrun.data.tags
    assert tags[f"monim.late.{day(7)}"] == f"wire ({day(7)})"  # filed for a learned day, in date order
    assert tags[f"monim.late.{day(6)}"] == f"older ({day(8)})"  # out of date order, after the next day's
    assert tags["monim.thin_days"] == f"{day(6)} (3 articles, median 16)"
    after = client.get_metric_history(mlrun.info.run_id, "8_data/docs_after_learned")
    assert [(m.step, m.value) for m in after] == [(rows[day(7)]["step"], 1)]
    assert any(f"{day(7)}: 1 late article(s) came after the day was learned, not learned: wire" in w for w in warnings)
    assert any(f"{day(6)}: a thin day: 3 articles" in w for w in warnings)
