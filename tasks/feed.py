"""What a stream's run says about its feed: a thin day and late articles, each a warning in the run's
log and a tag on its MLflow run (a stalled feed fails the daily run: flows.stream.learn_yesterday)."""

from __future__ import annotations

import datetime as dt
from statistics import median

from prefect import task
from prefect.cache_policies import NO_CACHE

from monim.core.run_config import RunConfig
from monim.data.day import Day, articles
from monim.plan import arrivals
from tasks.logs import logger
from tracking.runs import log_points
from tracking.store import client, one_at_a_time

THIN_SHARE = 0.25  # a day with fewer articles than this share of the median of the days before it is thin
THIN_DAYS = 7  # the learned days the median is taken over (the last ones before the day; at least 3)
SHOWN = 20  # articles named in a log line (a tag names as many as MLflow keeps)
TAG_LIMIT = 8000  # the longest tag value MLflow keeps
SEP = "; "


@task(retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
@one_at_a_time
def add_to_tag(run_id: str, uri: str, key: str, items: list[str]) -> None:
    """Add the items not there yet to a run's tag, a list of them (the newest kept under MLflow's limit)."""
    c = client(uri)
    have = [i for i in c.get_run(run_id).data.tags.get(key, "").split(SEP) if i]
    known = set(have)
    value = SEP.join(have + [i for i in dict.fromkeys(items) if i not in known])
    c.set_tag(run_id, key, value if len(value) <= TAG_LIMIT else "…" + value[1 - TAG_LIMIT:])


def say_late(run_id: str | None, uri: str | None, date: str, late: list[tuple[str, str]], why: str) -> None:
    """Name late articles ((id, date), read with `date`'s articles) in the run's log, a warning, and in
    its MLflow tag `monim.late.<date>`: counted and named, never learned; and bad records among them
    ((message, "")), a warning of their own."""
    named, bad = [f"{doc_id} ({day})" for doc_id, day in late if day], [name for name, day in late if not day]
    for what, names in (("late article(s)", named), ("bad record(s)", bad)):
        if names:
            more = f"{SEP}and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            logger().warning("%s: %d %s %s, not learned: %s%s", date, len(names), what, why, SEP.join(names[:SHOWN]), more)
    if run_id and uri and named:
        add_to_tag(run_id, uri, f"monim.late.{date}", named)


def say_skipped(date: str, day: Day) -> None:
    """Name the bad records a day skipped (`--on-error skip`) in the run's log, a warning: each one's file,
    line, field and problem (the first monim.data.stream.NAMED; the rest counted)."""
    if not day.skipped:
        return
    more = f"{SEP}and {day.skipped - len(day.bad)} more" if day.skipped > len(day.bad) else ""
    logger().warning("%s: %d bad record(s) skipped, not learned: %s%s", date, day.skipped, SEP.join(day.bad), more)


def arrived_late(cfg: RunConfig, row: dict, run_id: str, uri: str, found: list[tuple[str, str]] | None = None,
                 since: dt.date | None = None) -> int:
    """Say the records of a learned day (its row) that the feed got after the day was learned (say_late),
    and count them in MLflow (`docs_after_learned` at the day's step); how many there are. `found`:
    those records where the run's plan read them already (monim.plan.Plan.arrived), else read here
    from `since` (the first day whose records the day counted: monim.plan.Plan.since)."""
    if found is None:
        found = arrivals(cfg.source, {row["date"]: row}, cfg.on_error, cfg.fields(), since).get(row["date"], [])
    say_late(run_id, uri, row["date"], found, "came after the day was learned")
    if found:
        log_points(run_id, uri, [("docs_after_learned", row["step"], len(found))])
    return len(found)


def thin_day(run_id: str, uri: str, row: dict, rows: list[dict]) -> bool:
    """Whether the day (its row) had fewer articles than THIN_SHARE of the median of the THIN_DAYS
    learned days before it (`rows`: the run's); if so, a warning and the run's tag `monim.thin_days`."""
    before = sorted((r for r in rows if r["date"] < row["date"]), key=lambda r: r["date"])[-THIN_DAYS:]
    usual, n = median([articles(r, "docs_") for r in before] or [0]), articles(row, "docs_")
    if len(before) < 3 or n >= THIN_SHARE * usual:
        return False
    logger().warning("%s: a thin day: %d articles, fewer than %d%% of the median %g of the %d days before it",
                     row["date"], n, THIN_SHARE * 100, usual, len(before))
    add_to_tag(run_id, uri, "monim.thin_days", [f"{row['date']} ({n} articles, median {usual:g})"])
    return True
