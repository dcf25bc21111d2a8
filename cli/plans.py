"""The run's range planned before any work (monim.plan): what the command refuses in one line. The flow plans
it again under its lock, from the same read of the feed (monim.plan.read_feed: every record read once)."""

from __future__ import annotations

import datetime as dt
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from cli.errors import clear_errors, fail, option_date

if TYPE_CHECKING:
    from monim.core.run_config import RunConfig
    from monim.plan import Plan


@contextmanager
def refused_plans() -> Iterator[None]:
    """A plan that refuses its range (a missing feed, a reversed range, a day before a memory's last, a bad record
    naming its file, line and field, an id a memory read on another day), or a bad record a flow meets later,
    ends the command in one line."""
    from monim.data.feed import StreamError
    from monim.plan import RangeError

    with clear_errors(FileNotFoundError, StreamError, RangeError):
        yield


def check_plans(cfg: RunConfig, start: Optional[str], end: Optional[str], policies: Sequence[str],
                relearn: Sequence[str] = ()) -> dict[str, Plan]:
    """Plan each policy's range from START to END (dates, in order; `relearn`: ISO dates) before any work, or end
    in one line; a range without articles for any policy is refused here (a flow learns nothing from it). The
    plans, by policy."""
    from monim.plan import plan

    first, last = option_date(start), option_date(end)
    if first and last and first > last:
        raise fail(f"--start {start} is after --end {end}: the range holds no day")
    with refused_plans():
        plans = {policy: plan(cfg.model_copy(update={"policy": policy}), first, last,
                              [dt.date.fromisoformat(d) for d in relearn]) for policy in policies}
    if not any(p.dates for p in plans.values()):
        raise fail(f"{cfg.source} has no articles between {start or 'the start'} and {end or 'the end'}")
    return plans
