"""News streams: a source's records, day by day, each day split 98/1/1 into train, validation and test.

A stream refuses (or, with on_error="skip", skips and counts) what it cannot trust: a bad record, an
id met twice, a record dated after today. A late record (one out of date order, dated before a record
above it) is no error: it is counted and named in the day it is read with, never learned, and never
blocks a run. A feed with no article for the day to learn, past a lag, has stalled (FeedStalled).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Literal

from monim import dedup
from monim.config import DEMO_STREAM  # noqa: F401  (where readers of streams look for it)
from monim.sources import BadRecord, Document, Fields, Source, StreamError, open_source

SPLITS = ("train", "validation", "test")


@dataclass
class Day:
    """One streaming day, split into train / validation / test documents."""

    date: dt.date
    train: list[Document]
    validation: list[Document]
    test: list[Document]
    skipped: int = 0  # bad records skipped while reading this day (on_error="skip")
    duplicates: int = 0  # documents dropped because an earlier one that day had the same text
    groups: dict[str, str] = field(default_factory=dict)  # doc id -> its near-duplicate group (first doc's id)
    capped_out: int = 0  # training articles left out by a cap on articles a day (max_docs)
    truncated: int = 0  # articles cut to a cap on tokens an article
    titles_cut: int = 0  # headlines cut to monim.sources.TITLE_CAP characters at ingest
    texts_cut: int = 0  # articles cut to monim.sources.TEXT_CAP characters at ingest
    late: list[tuple[str, str]] = field(default_factory=list)  # (id, date) of late records read with the day, not learned

    @property
    def twin_groups(self) -> int:
        """Near-duplicate groups of two or more articles this day (monim.dedup)."""
        return sum(n > 1 for n in Counter(self.groups.values()).values())

    def capped(self, max_docs: int | None) -> Day:
        """The day with its first `max_docs` training articles only (None: all); the rest are counted in `capped`."""
        if max_docs is None or len(self.train) <= max_docs:
            return self
        return replace(self, train=self.train[:max_docs], capped_out=self.capped_out + len(self.train) - max_docs)

    def truncate(self, max_tokens: int | None, cut: Callable[[str, int], str]) -> Day:
        """The day with every article longer than `max_tokens` tokens cut to them (`cut(text, n)`: its
        first n tokens), counted in `truncated`."""
        if max_tokens is None:
            return self
        long = {d.id for split in SPLITS for d in self.split(split) if len(d.text) > max_tokens}  # a token has a character
        cuts = {d.id: cut(d.text, max_tokens) for split in SPLITS for d in self.split(split) if d.id in long}
        cuts = {i: text for i, text in cuts.items() if text is not None}

        def shorter(docs: list[Document]) -> list[Document]:
            return [replace(d, text=cuts[d.id]) if d.id in cuts else d for d in docs]

        return replace(self, train=shorter(self.train), validation=shorter(self.validation), test=shorter(self.test),
                       truncated=self.truncated + len(cuts))

    def split(self, name: str) -> list[Document]:
        """The documents of one split by name."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {SPLITS}")
        return getattr(self, name)

    def __len__(self) -> int:
        return len(self.train) + len(self.validation) + len(self.test)

    def counts(self) -> dict[str, int]:
        """Articles per split, and what reading the day dropped, skipped or grouped."""
        return {"train": len(self.train), "validation": len(self.validation), "test": len(self.test),
                "skipped": self.skipped, "duplicates": self.duplicates, "twin_groups": self.twin_groups,
                "capped": self.capped_out, "truncated": self.truncated, "titles_cut": self.titles_cut,
                "texts_cut": self.texts_cut, "late": len(self.late)}


def _rank(seed: int, doc_id: str) -> bytes:
    return hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()


def split_day(docs: list[Document], seed: int = 0, heldout: float = 0.01,
              groups: list[int] | None = None) -> tuple[list, list, list]:
    """Train / validation / test: the groups whose hash of (seed, first doc's id) ranks lowest are
    held out, a near-duplicate group (`groups`: a label per doc) always whole in one split.

    Each held-out split takes `heldout` of the day (1%), and at least one document when the day
    has three or more (a group that does not fit goes to train, unless the split is still empty);
    documents keep their source order within a split.
    """
    k = max(1, round(heldout * len(docs))) if len(docs) >= 3 else 0
    labels = list(range(len(docs))) if groups is None else groups
    members: dict[int, list[int]] = {}
    for i, g in enumerate(labels):
        members.setdefault(g, []).append(i)
    ranked = sorted(members.values(), key=lambda m: _rank(seed, docs[m[0]].id))
    role, room = {}, {"validation": k, "test": k}
    for group in ranked:
        split = next((s for s, r in room.items() if r > 0 and (len(group) <= r or r == k)), None)
        if split is None:
            continue
        room[split] -= len(group)
        role |= {i: split for i in group}
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for i, doc in enumerate(docs):
        out[role.get(i, "train")].append(doc)
    return out["train"], out["validation"], out["test"]


def _make_day(date: dt.date, docs: list[Document], seed: int, skipped: int, late: list[tuple[str, str]]) -> Day:
    """A day from its documents: exact repeats of a text dropped, near-duplicates grouped (and kept
    in one split, else a copy of a test article could be memorized), the caps met at ingest counted."""
    seen, unique = set(), []
    for doc in docs:
        digest = hashlib.sha256(doc.text.strip().encode()).digest()
        if digest not in seen:
            seen.add(digest)
            unique.append(doc)
    labels = dedup.twin_groups([d.text for d in unique])
    groups = {d.id: unique[g].id for d, g in zip(unique, labels)}
    cut = Counter(name for d in docs for name in d.cut)
    return Day(date, *split_day(unique, seed, groups=labels), skipped=skipped, duplicates=len(docs) - len(unique),
               groups=groups, titles_cut=cut["title"], texts_cut=cut["text"], late=late)


FUTURE_DAYS = 1  # a record dated more than this many days after today (by the clock) is a mis-dated one


def latest_date() -> dt.date:
    """The last date a record may have: today, with FUTURE_DAYS for time zones and late clocks."""
    return dt.date.today() + dt.timedelta(days=FUTURE_DAYS)


def _day_documents(source: Source, start: dt.date | None, end: dt.date | None, on_error: Literal["raise", "skip"]
                   ) -> Iterator[tuple[dt.date, list[Document], int, list[tuple[str, str]]]]:
    """(date, documents, bad records skipped, late records) of each day from start to end, in date
    order; an id met a second time, or a record dated after today, is a bad record. Bad records between
    two days count for the later one, whose range in the day index begins after the earlier one's last
    record, so that reading the days one by one counts each once. A late record (dated before a record
    above it) belongs to the day of the records above it (the day index has none: such a file is read
    from its start)."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    date, docs, skipped, pending, last = None, [], 0, 0, None  # pending: bad records since the last good one
    late: list[tuple[str, str]] = []
    first_at: dict[str, str] = {}  # id -> where it was met first
    for rec in source.records(start):
        if not isinstance(rec, BadRecord):
            where, doc = rec
            if doc.date > latest_date():
                rec = BadRecord(where, "date", f"{doc.date} is after today ({dt.date.today()}): a mis-dated record")
            elif doc.id in first_at and first_at[doc.id] != where:
                rec = BadRecord(where, "id", f"{doc.id!r} again: {first_at[doc.id]} has the same id")
            else:
                first_at.setdefault(doc.id, where)
        if isinstance(rec, BadRecord):
            if on_error == "raise":
                raise StreamError(str(rec))
            pending += 1
            continue
        where, doc = rec
        if last is not None and doc.date < last:  # late news never blocks a run, whatever on_error says
            if date is not None:  # else it comes before `start`: another day's
                late.append((doc.id, doc.date.isoformat()))
                skipped += pending
            pending = 0
            continue
        last = doc.date
        if start is not None and doc.date < start:
            pending = 0
            continue
        if end is not None and doc.date > end:
            pending = 0  # the next day's
            break
        if doc.date != date:
            if docs:
                yield date, docs, skipped, late
            date, docs, skipped, late = doc.date, [], 0, []
        skipped, pending = skipped + pending, 0
        docs.append(doc)
    if docs:
        yield date, docs, skipped + pending, late  # bad records at the end of the source: the last day's


def iter_days(
    source: Source,
    start: dt.date | None = None,
    end: dt.date | None = None,
    seed: int = 0,
    on_error: Literal["raise", "skip"] = "raise",
) -> Iterator[Day]:
    """The source's days from `start` to `end` (inclusive), in date order, one day in memory.

    A bad record raises StreamError, or with on_error="skip" is skipped and counted in the `skipped`
    of the day it falls in (between two days: the later). A late record (out of date order) is no
    error: it is named in the `late` of the day whose records it follows, not learned. A text repeated
    within a day is kept once (counted in `duplicates`); near-duplicates are grouped (`groups`).
    """
    for date, docs, skipped, late in _day_documents(source, start, end, on_error):
        yield _make_day(date, docs, seed, skipped, late)


def check_records(source: str | Path, start: dt.date | None = None, end: dt.date | None = None,
                  on_error: Literal["raise", "skip"] = "raise", fields: Fields | None = None) -> list[dt.date]:
    """Read every record from start to end before any work (StreamError at the first bad one, naming
    its file, line and field, unless skipped); the dates with articles."""
    dates = list_dates(source, start, end, on_error, fields)
    if not dates:
        return []
    return [d for d, *_ in _day_documents(open_source(source, fields), dates[0], dates[-1], on_error)]


def read_day(source: str | Path, date: dt.date, seed: int = 0, on_error: Literal["raise", "skip"] = "raise",
             fields: Fields | None = None) -> Day | None:
    """One day of a source, or None when it has no articles that day."""
    return next(iter_days(open_source(source, fields), start=date, end=date, seed=seed, on_error=on_error), None)


def list_dates(source: str | Path, start: dt.date | None = None, end: dt.date | None = None,
               on_error: Literal["raise", "skip"] = "raise", fields: Fields | None = None) -> list[dt.date]:
    """The dates between start and end (inclusive) on which the source has articles. Dates after
    today are refused (StreamError), or with on_error="skip" left out."""
    src = open_source(source, fields)
    known = src.dates()
    if known is None:  # no day index: read through (a record dated after today is a bad record there)
        return [date for date, *_ in _day_documents(src, start, end, on_error)]
    future = [d for d in known if d > latest_date()]
    if future and on_error == "raise":
        raise StreamError(f"{source}: field 'date': {len(future)} day(s) after today ({dt.date.today()}), from "
                          f"{future[0]}: mis-dated records (skip them: on_error=\"skip\", `--on-error skip`)")
    return [d for d in known if (start is None or d >= start) and (end is None or d <= end) and d <= latest_date()]


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


READ = ("train", "validation", "test", "duplicates", "capped")  # the counts that add up to a day's articles in the feed


def articles(counts: dict, prefix: str = "") -> int:
    """How many articles a day had in the feed, from its counts() (or a run's row: keys with `prefix`)."""
    return sum(counts.get(prefix + k, 0) for k in READ)


def arrived_after(source: str | Path, date: dt.date, read: int, late: int, on_error: Literal["raise", "skip"] = "raise",
                  fields: Fields | None = None) -> list[tuple[str, str]]:
    """(id, date) of a learned day's records that came after it was learned, when it had `read` articles
    and `late` late records: those past them in the feed's order (a feed is appended to at its end)."""
    for _, docs, _, now_late in _day_documents(open_source(source, fields), date, date, on_error):
        return [(d.id, d.date.isoformat()) for d in docs[read:]] + now_late[late:]
    return []
