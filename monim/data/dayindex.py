"""Day-indexed sources: reading day D costs O(that day), not O(everything before it).

A source file gets a date -> (offset, line) index, built by one pass over the file and kept in
monim's cache beside the file's size and mtime (rebuilt when either changes). Offsets are in the
uncompressed text; gzip files are read through `indexed_gzip`, whose seek points are kept too,
so a seek decompresses from the nearest point instead of the file's start.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from monim.core.atomic import replacing, write_json
from monim.core.config import cache_dir


@dataclass
class DayIndex:
    """Where each date's records start in a source file (None: the file is not sorted by date)."""

    path: Path
    starts: dict[str, tuple[int, int]] | None  # date -> (byte offset of its first record, line no.); the first date: (0, 1)

    def dates(self) -> list[dt.date]:
        return [dt.date.fromisoformat(d) for d in sorted(self.starts or {})]

    def start(self, date: dt.date) -> tuple[int, int] | None:
        """(offset, first line number) to read from for the records from `date` on (None: past the end)."""
        later = [d for d in sorted(self.starts or {}) if d >= date.isoformat()]
        return self.starts[later[0]] if later and self.starts is not None else None


def open_text(path: Path, seek_points: Path | None = None) -> IO[bytes]:
    """A seekable binary reader of a plain or gzip file (uncompressed offsets)."""
    if path.suffix != ".gz":
        return open(path, "rb")
    import indexed_gzip  # here: a machine that scores without reading news files (a GPU benchmark) lacks it

    if seek_points is not None and seek_points.exists():
        return indexed_gzip.IndexedGzipFile(str(path), index_file=str(seek_points))
    return indexed_gzip.IndexedGzipFile(str(path))


def _index_files(path: Path) -> tuple[Path, Path]:
    tag = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    folder = cache_dir() / "day-index"
    return folder / f"{tag}.json", folder / f"{tag}.gzidx"


def _stamp(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


RULE = 2  # where a day's lines start (kept with an index: one built by another rule is rebuilt)


def day_index(path: Path, date_of: Callable[[bytes], dt.date | None]) -> DayIndex:
    """The file's day index, from the cache when the file is unchanged, else built (one pass).

    `date_of(line)`: a record's date, or None for a line that is not a readable record."""
    meta, points = _index_files(path)
    stamp = _stamp(path) | {"rule": RULE}
    if meta.exists():
        cached = json.loads(meta.read_text())
        if cached["stamp"] == stamp and (path.suffix != ".gz" or points.exists()):
            return DayIndex(path, {d: tuple(v) for d, v in cached["starts"].items()} if cached["starts"] is not None else None)
    starts: dict[str, tuple[int, int]] = {}
    ordered, last, at = True, None, 0
    with open_text(path) as f:
        for n, raw in enumerate(iter(f.readline, b""), start=1):
            date = date_of(raw.removeprefix(BOM) if n == 1 else raw)
            if date is not None:
                if last is not None and date < last:
                    ordered = False  # unsorted: readers scan the whole file (and name its late records)
                    break
                if date != last:  # the lines above the first dated one are the first day's (monim.data.stream)
                    starts[date.isoformat()] = (at, n) if starts else (0, 1)
                    last = date
            at = f.tell()
        if path.suffix == ".gz":
            gz: Any = f  # indexed_gzip's reader (open_text)
            gz.build_full_index()
            with replacing(points) as tmp:
                gz.export_index(str(tmp))
    kept = starts if ordered else None
    write_json(meta, {"stamp": stamp, "starts": kept}, indent=None)
    return DayIndex(path, kept)


def open_at(path: Path, offset: int = 0) -> IO[bytes]:
    """A binary reader positioned at `offset` of the uncompressed text (a gzip file's seek points used)."""
    f = open_text(path, _index_files(path)[1])
    if offset:
        f.seek(offset)
    return f


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, which some editors write first
READS: Counter = Counter()  # path -> times a source file was opened for reading (what a day flow costs)
RECORDS: Counter = Counter()  # path -> records read from it (what planning and learning a range cost)


class IndexedFile:
    """A source file read from a date on through its day index (monim.data.dayindex)."""

    path: Path

    def date_of(self, raw: bytes) -> dt.date | None:
        """A line's date, or None where the line is not a readable record."""
        raise NotImplementedError

    def index(self) -> DayIndex:
        return day_index(self.path, self.date_of)

    def dates(self) -> list[dt.date] | None:
        index = self.index()
        return index.dates() if index.starts is not None else None

    def lines(self, start: dt.date | None) -> Iterator[tuple[str, bytes]]:
        """Raw lines that are not blank, each with its place (`path:line`), from `start`'s first record when
        the index knows it."""
        offset, line = 0, 1
        if start is not None and (index := self.index()).starts is not None:
            if (at := index.start(start)) is None:
                return
            offset, line = at
        READS[str(self.path)] += 1
        with open_at(self.path, offset) as f:
            for n, raw in enumerate(iter(f.readline, b""), start=line):
                raw = raw.rstrip(b"\r\n").removeprefix(BOM) if n == 1 else raw.rstrip(b"\r\n")
                if raw.strip():
                    RECORDS[str(self.path)] += 1
                    yield f"{self.path}:{n}", raw
