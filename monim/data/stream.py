"""News streams: a feed's records read day by day, each day made a Day (monim.data.day).

A stream refuses (or, with on_error="skip", skips and counts) what it cannot trust: a bad record, an
id met twice, a record dated after today. A late record (one out of date order, dated before a record
above it) is no error: it is counted and named in the day it is read with, never learned, and never
blocks a run. A feed with no article for the day to learn, past a lag, has stalled (FeedStalled).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Mapping

from monim.data import dedup
from monim.data.day import Day, split_day
from monim.data.feed import BadRecord, Document, Feed, Fields, Record, StreamError, open_feed

NAMED = 20  # bad records a day keeps to name (file, line, field, problem); the rest are counted


def _make_day(gathered: Gathered, seed: int) -> Day:
    """A day from its documents: exact repeats of a text dropped, near-duplicates grouped (and kept
    in one split, else a copy of a test article could be memorized), the caps met at ingest counted."""
    docs, seen, unique = gathered.docs, set(), []
    for doc in docs:
        digest = hashlib.sha256(doc.text.strip().encode()).digest()
        if digest not in seen:
            seen.add(digest)
            unique.append(doc)
    labels = dedup.twin_groups([d.text for d in unique])
    groups = {d.id: unique[g].id for d, g in zip(unique, labels)}
    cut = Counter(name for d in docs for name in d.cut)
    return Day(gathered.date, *split_day(unique, seed, groups=labels), skipped=gathered.skipped, bad=gathered.bad,
               duplicates=len(docs) - len(unique), groups=groups, titles_cut=cut["title"], texts_cut=cut["text"],
               late=gathered.late, ids=tuple(d.id for d in docs))


FUTURE_DAYS = 1  # a record dated more than this many days after today (by the clock) is a mis-dated one


def latest_date() -> dt.date:
    """The last date a record may have: today, with FUTURE_DAYS for time zones and late clocks."""
    return dt.date.today() + dt.timedelta(days=FUTURE_DAYS)


Known = Mapping[str, tuple[str, str]]  # doc id -> (the day a memory read it, what it did: "<memory> learned")


@dataclass
class Gathered:
    """The records a day counts: its documents, its bad records skipped, its late records (id, date)."""

    date: dt.date
    docs: list[Document] = field(default_factory=list)
    skipped: int = 0
    late: list[tuple[str, str]] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # the first NAMED bad records skipped, as their messages say them
    read: list[tuple[str, str]] = field(default_factory=list)  # every record counted, in feed order, as after() names it

    @property
    def records(self) -> int:
        """The records the day counts: its documents, bad records and late ones."""
        return len(self.docs) + self.skipped + len(self.late)

    def after(self, records: int) -> list[tuple[str, str]]:
        """The records past the first `records` the day counted: what it got after it was learned with
        those (a feed is appended to at its end), in feed order: (id, date) of an article, in date order or
        late, and (its message, "") of a bad record."""
        return self.read[records:]

    def fold(self, earlier: Gathered) -> None:
        """Count a day without articles (bad or late records only) with this one, the next day learned."""
        self.skipped += earlier.skipped
        self.late = earlier.late + self.late
        self.bad = (earlier.bad + self.bad)[:NAMED]
        self.read = earlier.read + self.read


def _day_documents(feed: Feed, start: dt.date | None, end: dt.date | None, on_error: Literal["raise", "skip"],
                   known: Known | None = None) -> Iterator[Gathered]:
    """What each day from start to end counts, in date order, every record of the range in exactly one
    day (read whole or day by day through the day index alike), decided by the records above it only
    (so a feed appended to at its end never moves a record to another day):

    - a record with a readable date counts for that day, good or bad; one dated before a record above
      it (late) counts for the day being read (the latest date above it), named in its `late` if good
      (never learned, no error);
    - a record without a readable date (malformed, or dated after today) counts for the day being read
      too; one above every dated record, for the first day (the day index starts the first day at the
      file's start, and every other day at its first dated record).

    Bad records: an unreadable record, a record dated after today, an id met a second time, and an id
    that `known` holds from another day (a memory's: learned or forgotten there). They raise
    StreamError once counted for a day in the range, or with on_error="skip" count in its `skipped`;
    a bad record beyond `end` refuses nothing. A day may have no documents (only bad or late records)."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    day: Gathered | None = None
    first: list[BadRecord] = []  # records without a readable date above every dated one: the first day's
    last: dt.date | None = None  # the latest date met
    first_at: dict[str, str] = {}  # id -> where it was met first
    known = known or {}

    def count(bad: list[BadRecord]) -> None:
        if bad and on_error == "raise":
            raise StreamError(str(bad[0]))
        assert day is not None  # a day is being read once a record is counted
        day.skipped += len(bad)
        day.bad += [str(b) for b in bad[: NAMED - len(day.bad)]]
        day.read += [(str(b), "") for b in bad]

    for rec in feed.records(start):
        if not isinstance(rec, BadRecord) and rec[1].date > latest_date():
            rec = BadRecord(rec[0], "date", f"{rec[1].date} is after today ({dt.date.today()}): a mis-dated record")
        date = rec.date if isinstance(rec, BadRecord) else rec[1].date
        if date is None or (last is not None and date < last):  # the day being read counts it (if in the range)
            if last is None:
                assert isinstance(rec, BadRecord)  # no date yet: no record read so far had a readable one
                first.append(rec)
            elif day is not None:
                rec = _repeated(rec, first_at, {})
                if isinstance(rec, BadRecord):
                    count([rec])
                else:
                    day.late.append((rec[1].id, rec[1].date.isoformat()))
                    day.read.append(day.late[-1])
            continue
        last = date
        if start is not None and date < start:
            first = []
            continue
        if end is not None and date > end:
            break  # the next day's
        if day is None or date != day.date:
            if day is not None:
                yield day
            day = Gathered(date)
            count(first)
            first = []
        rec = _repeated(rec, first_at, known)
        if isinstance(rec, BadRecord):
            count([rec])
        else:
            day.docs.append(rec[1])
            day.read.append((rec[1].id, rec[1].date.isoformat()))
    if day is None and first and on_error == "raise":  # no dated record takes them
        raise StreamError(str(first[0]))
    if day is not None:
        yield day


def _repeated(rec: Record, first_at: dict[str, str], known: Known) -> Record:
    """The record, or a BadRecord where its id was met before in this read or a memory holds it from
    another day (its date kept: it counts for its day)."""
    if isinstance(rec, BadRecord):
        return rec
    where, doc = rec
    if doc.id in first_at and first_at[doc.id] != where:
        return BadRecord(where, "id", f"{doc.id!r} again: {first_at[doc.id]} has the same id", doc.date)
    held = known.get(doc.id)
    if held is not None and held[0] != doc.date.isoformat():
        return BadRecord(where, "id", f"{doc.id!r} again: {held[1]} an article of {held[0]} with this id (an id names "
                                      "one article)", doc.date)
    first_at.setdefault(doc.id, where)
    return rec


def _articled(days: Iterator[Gathered]) -> Iterator[Gathered]:
    """The days with articles, each counting the days without any just before it (folded into it)."""
    carry = None
    for gathered in days:
        if carry is not None:
            gathered.fold(carry)
        carry = None if gathered.docs else gathered
        if gathered.docs:
            yield gathered


def iter_days(
    feed: Feed,
    start: dt.date | None = None,
    end: dt.date | None = None,
    seed: int = 0,
    on_error: Literal["raise", "skip"] = "raise",
    known: Known | None = None,
) -> Iterator[Day]:
    """The feed's days with articles from `start` to `end` (inclusive), in date order, one day in RAM.

    A bad record raises StreamError, or with on_error="skip" is skipped and counted in the `skipped`
    of its day (monim.data.stream._day_documents says which); a day without articles counts with the next
    day that has some. A late record (out of date order) is no error: it is named in the `late` of the
    day whose records it follows, not learned. An id `known` to a memory from another day is a bad
    record. A text repeated within a day is kept once (counted in `duplicates`); near-duplicates are
    grouped (`groups`).
    """
    for gathered in _articled(_day_documents(feed, start, end, on_error, known)):
        yield _make_day(gathered, seed)


def read_range(source: str | Path, start: dt.date | None = None, end: dt.date | None = None,
               on_error: Literal["raise", "skip"] = "raise", fields: Fields | None = None,
               known: Known | None = None) -> Iterator[Gathered]:
    """Every record from start to end, read once, a day with articles at a time (StreamError at the
    first bad one, naming its file, line and field, unless skipped)."""
    feed = open_feed(source, fields)
    if feed.dates() is not None:  # days after today refused by the day index, before reading (else the read refuses them)
        list_dates(source, start, end, on_error, fields)
    return _articled(_day_documents(feed, start, end, on_error, known))


def check_records(source: str | Path, start: dt.date | None = None, end: dt.date | None = None,
                  on_error: Literal["raise", "skip"] = "raise", fields: Fields | None = None,
                  known: Known | None = None) -> list[dt.date]:
    """Read every record from start to end before any work (read_range); the dates with articles."""
    return [g.date for g in read_range(source, start, end, on_error, fields, known)]


def read_day(source: str | Path, date: dt.date, seed: int = 0, on_error: Literal["raise", "skip"] = "raise",
             fields: Fields | None = None, since: dt.date | None = None, known: Known | None = None) -> Day | None:
    """One day of the feed, or None when it has no articles that day. `since`: the first day after the
    run's previous day with articles, whose records (bad or late only) this day counts too."""
    days = iter_days(open_feed(source, fields), since or date, date, seed, on_error, known)
    return next((d for d in days if d.date == date), None)


def list_dates(source: str | Path, start: dt.date | None = None, end: dt.date | None = None,
               on_error: Literal["raise", "skip"] = "raise", fields: Fields | None = None) -> list[dt.date]:
    """The dates between start and end (inclusive) on which the feed has articles. Dates after
    today are refused (StreamError), or with on_error="skip" left out."""
    feed = open_feed(source, fields)
    indexed = feed.dates()
    if indexed is None:  # no day index: read through (a record dated after today is a bad record there)
        return [g.date for g in _articled(_day_documents(feed, start, end, on_error))]
    future = [d for d in indexed if d > latest_date() and (end is None or d <= end)]
    if future and on_error == "raise":
        raise StreamError(f"{source}: field 'date': {len(future)} day(s) after today ({dt.date.today()}), from "
                          f"{future[0]}: mis-dated records (skip them: on_error=\"skip\", `--on-error skip`)")
    return [d for d in indexed if (start is None or d >= start) and (end is None or d <= end) and d <= latest_date()]


class FeedStalled(RuntimeError):
    """The feed has no article for the day the daily run should learn, nor for the lag allowed before it."""


def check_feed(source: str | Path, day: dt.date, max_lag: int, on_error: Literal["raise", "skip"] = "raise",
               fields: Fields | None = None) -> dt.date:
    """The feed's last date with articles, at most `max_lag` days before `day` (the day to learn); else
    FeedStalled naming the feed, its last date and how many days it lags."""
    dates = list_dates(source, None, None, on_error, fields)
    if not dates:
        raise FeedStalled(f"{source}: the feed has no articles at all (the day to learn is {day})")
    lag = (day - dates[-1]).days
    if lag > max_lag:
        raise FeedStalled(f"{source}: the feed has stalled: its last article is dated {dates[-1]}, {lag} days before "
                          f"{day}, the day to learn (max_feed_lag {max_lag})")
    return dates[-1]


def arrived_after(source: str | Path, date: dt.date, records: int, since: dt.date | None = None,
                  on_error: Literal["raise", "skip"] = "raise", fields: Fields | None = None) -> list[tuple[str, str]]:
    """The records a learned day got after it was learned with `records` of them, read from `since` as it was
    learned (the days from `since` without articles counting with it): Gathered.after."""
    for gathered in _articled(_day_documents(open_feed(source, fields), min(since or date, date), date, on_error)):
        if gathered.date == date:
            return gathered.after(records)
    return []
