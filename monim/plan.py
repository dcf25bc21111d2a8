"""What a run's range holds, read before any work: its days with articles (every record read, bad
ones refused or counted), the days the run learned, the days its memory forgot (never learned again
unless relearned by name), and what is left to learn. A range that cannot be learned (reversed, or
with a day before the memory's last) is refused here, before the LM runs or anything is written."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Literal, Sequence

from monim.core.config import RunConfig
from monim.core.manifest import read_manifest
from monim.data.sources import Fields
from monim.data.stream import arrived_after, read_range, records
from monim.storage import workdirs
from monim.storage.forgotten import check_relearn, forgotten_days


@dataclass
class Plan:
    """A run's range: what it holds and what is left to learn."""

    dates: list[str]  # the days with articles in the range
    learned: dict[str, dict]  # date -> row of every day the run learned (before the range too)
    forgotten: dict[str, dict]  # date -> the forget, of the range's days the memory forgot
    relearn: list[str] = field(default_factory=list)  # days asked by name to be learned again
    start: str | None = None
    arrived: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # learned day -> (id, date) it got since
    records: dict[str, int] = field(default_factory=dict)  # day -> the records it counts in the feed now

    @property
    def todo(self) -> list[str]:
        """The days to learn, in date order."""
        return [d for d in self.dates if d in self.relearn or (d not in self.learned and d not in self.forgotten)]

    @property
    def seen(self) -> list[str]:
        """The learned days of the range this run reads again (for the articles they got since)."""
        return [d for d in self.dates if d in self.learned and d not in self.relearn]

    def since(self, date: str) -> str:
        """The first day whose records `date` counts: the day after the run's previous day with articles
        (days between hold only bad or late records), else the range's start (the feed's, if none)."""
        before = [d for d in [*self.dates, *self.learned, *self.forgotten] if d < date]
        after = (dt.date.fromisoformat(max(before)) + dt.timedelta(days=1)).isoformat() if before else None
        return after or self.start or dt.date.min.isoformat()


def last_read(cfg: RunConfig) -> str | None:
    """The last day the run learned or its memory forgot (a stream resumes after it)."""
    return max([*workdirs.read_rows(cfg.workdir, cfg.name), *forgotten_days(_manifest(cfg))], default=None)


def _manifest(cfg: RunConfig) -> dict:
    path = workdirs.memory_root(cfg.workdir, cfg.name) / "manifest.json"
    return read_manifest(path) if path.exists() else {}


def plan(cfg: RunConfig, start: dt.date | None = None, end: dt.date | None = None, relearn: Sequence[str] = ()) -> Plan:
    """The run's range from start to end, every record read (StreamError at a bad one, unless skipped;
    an id the memory read on another day is one); ValueError for a range that cannot be learned."""
    if start and end and start > end:
        raise ValueError(f"start {start} is after end {end}: the range holds no day")
    root, manifest = workdirs.memory_root(cfg.workdir, cfg.name), _manifest(cfg)
    rows, dates, arrived, counted = workdirs.read_rows(cfg.workdir, cfg.name), [], {}, {}
    for day in read_range(cfg.source, start, end, cfg.on_error, cfg.fields(), workdirs.known_ids(root)):
        dates.append(date := day.date.isoformat())
        counted[date] = day.records
        if date in rows and (found := day.after(records(rows[date], "docs_"))):
            arrived[date] = found  # a learned day read again: what it got since
    committed = [d["date"] for d in manifest.get("days", [])]
    gone = forgotten_days(manifest)
    out = Plan(dates, rows, {d: e for d, e in gone.items() if d in dates}, list(relearn),
               start.isoformat() if start else None, arrived, counted)
    for date in relearn:
        if not manifest:
            raise ValueError(f"relearn {date}: {cfg.name} keeps no memory to learn a day into again")
        if date not in dates:
            raise ValueError(f"relearn {date}: the range holds no articles of {date}")
        check_relearn(manifest, date)
    early = [d for d in out.todo if committed and d < committed[-1] and d not in committed]
    if early:
        raise ValueError(f"start: {early[0]} comes before the last day {root} committed, {committed[-1]}: a memory only "
                         f"grows at its end (start after {committed[-1]}, or learn {early[0]} into another work directory)")
    return out


def arrivals(source: str, rows: dict[str, dict], on_error: Literal["raise", "skip"] = "skip",
             fields: Fields | None = None, since: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """The records each learned day (date -> its row) got in the feed after it was learned (id, date) of
    each article (in date order, or late) and (message, "") of each bad record, for the days that got any;
    each day read from the day after the row before it (`since` for the first: the day after the run's
    previous day, as it was learned)."""
    found, start = {}, dt.date.fromisoformat(since) if since else None
    for date, row in sorted(rows.items()):
        day = dt.date.fromisoformat(date)
        found[date] = arrived_after(source, day, records(row, "docs_"), start, on_error, fields)
        start = day + dt.timedelta(days=1)
    return {date: late for date, late in found.items() if late}
