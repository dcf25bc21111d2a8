"""What a run's range holds, read before any work: its days with articles (every record read once, bad
ones refused or counted, the read shared by every run over the range), the days the run learned, the
days its memory forgot (never learned again unless relearned by name), and what is left to learn. A
range that cannot be learned (reversed, or with a day before the memory's last) is refused here (RangeError),
before the LM runs or anything is written; a range without articles is nothing to learn."""

from __future__ import annotations

import datetime as dt
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Sequence

from monim.core.catalogue import MEMORY
from monim.core.config import DEFAULT_MODEL
from monim.core.manifest import MemoryMismatch, read_manifest
from monim.core.run_config import RunConfig
from monim.data.day import records
from monim.data.feed import Fields
from monim.data.stream import Gathered, arrived_after, read_range
from monim.storage import workdirs
from monim.storage.forgotten import check_relearn, forgotten_days
from monim.storage.memory_settings import Settings, refuse_other


class RangeError(ValueError):
    """A range that cannot be learned: reversed, or with a day before the memory's last."""


@dataclass(frozen=True)
class Feed:
    """A range of a feed, every record read once: each day with articles -> every record it counts, in feed
    order ((id, date) of an article, in date order or late; (message, "") of a bad one: Gathered.read)."""

    read: dict[dt.date, list[tuple[str, str]]]

    @property
    def dates(self) -> list[dt.date]:
        return list(self.read)

    @staticmethod
    def of(days: Iterable[Gathered]) -> Feed:
        """The records of days read one at a time (their articles' texts not kept)."""
        return Feed({g.date: g.read for g in days})

    def known_again(self, known: dict[str, tuple[str, str]]) -> bool:
        """Whether an article of the range has an id `known` to a memory from another day (a bad record)."""
        return any(known.get(doc_id, (day,))[0] != day for date, read in self.read.items()
                   for doc_id, day in read if day == date.isoformat())


def read_feed(cfg: RunConfig, start: dt.date | None = None, end: dt.date | None = None) -> Feed:
    """The run's feed from start to end, read once for every run over it while the feed is unchanged (a
    comparison's policies share it); StreamError at a bad record (unless skipped), FileNotFoundError."""
    return _read(cfg.source, start, end, cfg.on_error, cfg.fields(), _stamp(cfg.source))


@functools.lru_cache(maxsize=1)
def _read(source: str, start: dt.date | None, end: dt.date | None, on_error: Literal["raise", "skip"], fields: Fields,
          stamp: tuple) -> Feed:
    return Feed.of(read_range(source, start, end, on_error, fields))


def _stamp(source: str) -> tuple:
    """What changes when the feed does: each file's size and modification time (a dataset: its name)."""
    path = Path(source)
    files = sorted(path.iterdir()) if path.is_dir() else [path] if path.is_file() else []
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


@dataclass
class Plan:
    """A run's range: what it holds and what is left to learn."""

    dates: list[dt.date]  # the days with articles in the range
    learned: dict[dt.date, dict]  # date -> row of every day the run learned (before the range too)
    forgotten: dict[dt.date, dict]  # date -> the forget, of the range's days the memory forgot
    relearn: list[dt.date] = field(default_factory=list)  # days asked by name to be learned again
    start: dt.date | None = None
    arrived: dict[dt.date, list[tuple[str, str]]] = field(default_factory=dict)  # learned day -> (id, date) it got since
    records: dict[dt.date, int] = field(default_factory=dict)  # day -> the records it counts in the feed now

    @property
    def todo(self) -> list[dt.date]:
        """The days to learn, in date order."""
        return [d for d in self.dates if d in self.relearn or (d not in self.learned and d not in self.forgotten)]

    @property
    def seen(self) -> list[dt.date]:
        """The learned days of the range this run reads again (for the articles they got since)."""
        return [d for d in self.dates if d in self.learned and d not in self.relearn]

    @property
    def nothing_new(self) -> bool:
        """Nothing to learn, and no record arrived for a learned day since it was learned: a run over the
        range changes nothing in its memory and says nothing new."""
        return not self.todo and not self.arrived

    def said(self, name: str) -> list[tuple[int, str]]:
        """The range as a run's log says it, (logging level, message): its days, those learned, forgotten and
        left to learn."""
        out = [(logging.INFO, f"{name}: {len(self.dates)} days in range, {len(self.seen)} already learned, "
                              f"{len(self.forgotten)} forgotten, {len(self.todo)} to learn")]
        for date, event in self.forgotten.items():
            if date not in self.relearn:
                reason = f" ({event['reason']})" if event.get("reason") else ""
                out.append((logging.WARNING, f"{name}: {date} was forgotten on {event['when']}{reason}: its "
                                             f"{self.records[date]} records not learned again (`--relearn {date}` learns it)"))
        if self.dates and not self.todo:
            out.append((logging.INFO, f"{name}: every day from {self.dates[0]} to {self.dates[-1]} is learned or "
                                      "forgotten: nothing to learn"))
        return out

    def since(self, date: dt.date) -> dt.date:
        """The first day whose records `date` counts: the day after the run's previous day with articles
        (days between hold only bad or late records), else the range's start (the feed's, if none)."""
        before = [d for d in [*self.dates, *self.learned, *self.forgotten] if d < date]
        return max(before) + dt.timedelta(days=1) if before else self.start or dt.date.min


def last_read(cfg: RunConfig) -> dt.date | None:
    """The last day the run learned or its memory forgot (a stream resumes after it)."""
    last = max([*workdirs.read_rows(cfg.workdir, cfg.name), *forgotten_days(_manifest(cfg))], default=None)
    return dt.date.fromisoformat(last) if last else None


def _manifest(cfg: RunConfig) -> dict:
    path = workdirs.memory_root(cfg.workdir, cfg.name) / "manifest.json"
    return read_manifest(path) if path.exists() else {}


def refuse_settings(cfg: RunConfig, policies: Sequence[str]) -> None:
    """Refuse, without the LM, a work directory whose memories another model learned (one model per work
    directory), or a policy's memory learned with other settings, naming the fields (MemoryMismatch,
    SettingsMismatch); the LM's weights and tokenizer are checked where a run opens its memory (monim.run)."""
    model = cfg.model or DEFAULT_MODEL
    for root in workdirs.memories(cfg.workdir):
        if (built := read_manifest(root / "manifest.json")["model"]) != model:
            raise MemoryMismatch(f"{root} was learned with model {built!r}, not {model!r}: use another --workdir")
    for policy in policies:
        run = cfg.model_copy(update={"policy": policy})
        if run.kind == MEMORY and (manifest := _manifest(run)):
            refuse_other(manifest, model, Settings.of(run), where=workdirs.memory_root(run.workdir, run.name))


def plan(cfg: RunConfig, start: dt.date | None = None, end: dt.date | None = None, relearn: Sequence[dt.date] = ()) -> Plan:
    """The run's range from start to end: the feed's read (read_feed, shared) and the memory's manifest.
    StreamError at a bad record (unless skipped; an id the memory read on another day is one);
    FileNotFoundError for a missing feed; RangeError for a range that cannot be learned (a range without
    articles is nothing to learn: the command line refuses it, a daily flow learns nothing)."""
    if start and end and start > end:
        raise RangeError(f"start {start} is after end {end}: the range holds no day")
    root, manifest = workdirs.memory_root(cfg.workdir, cfg.name), _manifest(cfg)
    feed, known = read_feed(cfg, start, end), workdirs.known_ids(root)
    if feed.known_again(known):  # read again with the memory's ids: refused naming its record, or skipped and counted
        feed = Feed.of(read_range(cfg.source, start, end, cfg.on_error, cfg.fields(), known))
    rows = {dt.date.fromisoformat(d): row for d, row in workdirs.read_rows(cfg.workdir, cfg.name).items()}
    arrived = {d: found for d in feed.dates if d in rows and (found := feed.read[d][records(rows[d], "docs_"):])}
    committed = [dt.date.fromisoformat(d["date"]) for d in manifest.get("days", [])]
    gone = {dt.date.fromisoformat(d): event for d, event in forgotten_days(manifest).items()}
    out = Plan(feed.dates, rows, {d: e for d, e in gone.items() if d in feed.read}, list(relearn), start, arrived,
               {d: len(read) for d, read in feed.read.items()})
    for date in relearn:
        if not manifest:
            raise RangeError(f"relearn {date}: {cfg.name} keeps no memory to learn a day into again")
        if date not in feed.read:
            raise RangeError(f"relearn {date}: the range holds no articles of {date}")
        try:
            check_relearn(manifest, date.isoformat())
        except ValueError as e:
            raise RangeError(str(e)) from None
    early = [d for d in out.todo if committed and d < committed[-1] and d not in committed]
    if early:
        raise RangeError(f"start: {early[0]} comes before the last day {root} committed, {committed[-1]}: a memory "
                         f"only grows at its end (start after {committed[-1]}, or learn {early[0]} into another work directory)")
    return out


def arrivals(source: str, rows: dict[str, dict], on_error: Literal["raise", "skip"] = "skip",
             fields: Fields | None = None, since: dt.date | None = None) -> dict[str, list[tuple[str, str]]]:
    """The records each learned day (date -> its row) got in the feed after it was learned (id, date) of
    each article (in date order, or late) and (message, "") of each bad record, for the days that got any;
    each day read from the day after the row before it (`since` for the first: the day after the run's
    previous day, as it was learned)."""
    found, start = {}, since
    for date, row in sorted(rows.items()):
        day = dt.date.fromisoformat(date)
        found[date] = arrived_after(source, day, records(row, "docs_"), start, on_error, fields)
        start = day + dt.timedelta(days=1)
    return {date: late for date, late in found.items() if late}
