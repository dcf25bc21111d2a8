"""News streams: dated documents from JSON Lines, WMT News Crawl or `datasets`, day by day."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Literal, Protocol

from monim import dedup
from monim.dayindex import IndexedFile

DEMO_STREAM = Path(__file__).parent / "data" / "reuters-1987-03-02_03-13.jsonl.gz"
SPLITS = ("train", "validation", "test")


class StreamError(ValueError):
    """A bad record in a news source; the message names file, line and field."""


@dataclass(frozen=True)
class Document:
    """One dated news article."""

    id: str
    date: dt.date
    text: str
    title: str = ""  # the headline, where the record has one (shown as a source of generated text)


@dataclass(frozen=True)
class BadRecord:
    """A record that could not be read: where it is and what is wrong with it."""

    where: str
    field: str | None
    problem: str

    def __str__(self) -> str:
        what = f"field '{self.field}': " if self.field else ""
        return f"{self.where}: {what}{self.problem}"


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

    @property
    def twin_groups(self) -> int:
        """Near-duplicate groups of two or more articles this day (monim.dedup)."""
        return sum(n > 1 for n in Counter(self.groups.values()).values())

    def capped(self, max_docs: int | None) -> Day:
        """The day with its first `max_docs` training articles only (None: all); the rest are counted in `capped`."""
        if max_docs is None or len(self.train) <= max_docs:
            return self
        return replace(self, train=self.train[:max_docs], capped_out=self.capped_out + len(self.train) - max_docs)

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
                "capped": self.capped_out}


@dataclass(frozen=True)
class Fields:
    """Names of the record fields that hold the date, the text and the document id."""

    date: str = "date"
    text: str = "text"
    id: str = "id"
    title: str = "title"  # optional


Record = tuple[str, Document] | BadRecord


class Source(Protocol):
    """Anything that yields records ("where", Document) or BadRecord, sorted by date; with `start`,
    it may begin at that date's first record (and `dates()`: the dates it has, None if unknown)."""

    def records(self, start: dt.date | None = None) -> Iterator[Record]: ...

    def dates(self) -> list[dt.date] | None: ...


def parse_date(value: Any) -> dt.date:
    """A date from 'YYYY-MM-DD', 'YYYYMMDD', an ISO timestamp, or a date/datetime object."""
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, dt.date):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a date string, got {value!r}")
    text = value.strip()
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).date()


def to_document(row: dict, fields: Fields, where: str) -> Record:
    """A Document from one record's fields, or a BadRecord saying which field is wrong."""
    if fields.date not in row or row[fields.date] in (None, ""):
        return BadRecord(where, fields.date, "missing")
    try:
        date = parse_date(row[fields.date])
    except ValueError as e:
        return BadRecord(where, fields.date, f"unparsable date {row[fields.date]!r} ({e})")
    text = row.get(fields.text)
    if not isinstance(text, str) or not text.strip():
        return BadRecord(where, fields.text, "missing or empty text")
    doc_id, title = row.get(fields.id), row.get(fields.title)
    return where, Document(id=str(doc_id) if doc_id not in (None, "") else where, date=date, text=text,
                           title=title.strip() if isinstance(title, str) else "")


def _decode(raw: bytes, where: str, field: str | None) -> str | BadRecord:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRecord(where, field, f"not valid UTF-8 (byte {e.start}: {e.reason})")


@dataclass
class JsonlSource(IndexedFile):
    """JSON Lines, plain or .gz, one article per line with a date and a text field."""

    path: Path
    fields: Fields = field(default_factory=Fields)

    def date_of(self, raw: bytes) -> dt.date | None:
        try:
            row = json.loads(raw)
            return parse_date(row[self.fields.date]) if isinstance(row, dict) else None
        except (ValueError, KeyError, TypeError):
            return None

    def records(self, start: dt.date | None = None) -> Iterator[Record]:
        for n, raw in self.lines(start):
            where = f"{self.path}:{n}"
            if not raw.strip():
                continue
            line = _decode(raw, where, None)
            if isinstance(line, BadRecord):
                yield line
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield BadRecord(where, None, f"malformed JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(row, dict):
                yield BadRecord(where, None, f"expected a JSON object, got {type(row).__name__}")
                continue
            yield to_document(row, self.fields, where)


@dataclass
class NewsCrawlSource(IndexedFile):
    """WMT document-level News Crawl: `date <TAB> base64 sentence-split doc <TAB> base64 doc`."""

    path: Path

    def date_of(self, raw: bytes) -> dt.date | None:
        try:
            return parse_date(raw.split(b"\t", 1)[0].decode())
        except ValueError:
            return None

    def records(self, start: dt.date | None = None) -> Iterator[Record]:
        for n, raw in self.lines(start):
            where = f"{self.path}:{n}"
            if not raw.strip():
                continue
            cols = raw.split(b"\t")
            if len(cols) < 3:
                yield BadRecord(where, None, f"expected 3 tab-separated columns, got {len(cols)}")
                continue
            date = _decode(cols[0], where, "date")
            if isinstance(date, BadRecord):
                yield date
                continue
            try:
                text = _decode(base64.b64decode(cols[2], validate=True), where, "text")
            except binascii.Error as e:
                yield BadRecord(where, "text", f"invalid base64 ({e})")
                continue
            if isinstance(text, BadRecord):
                yield text
                continue
            yield to_document({"date": date, "text": text}, Fields(), where)


@dataclass
class DirectorySource:
    """A folder of per-day files named by their date (`2022-06-01.jsonl.gz`, `2022-06-01-b.jsonl`),
    each JSON Lines or News Crawl; reading day D opens only D's files."""

    path: Path
    fields: Fields = field(default_factory=Fields)

    def files(self) -> list[tuple[dt.date, Path]]:
        out = []
        for f in sorted(self.path.iterdir()):
            try:
                out.append((dt.date.fromisoformat(f.name[:10]), f))
            except ValueError:
                continue  # not a day file (a README, say)
        return out

    def dates(self) -> list[dt.date]:
        return sorted({d for d, _ in self.files()})

    def records(self, start: dt.date | None = None) -> Iterator[Record]:
        for date, f in self.files():
            if start is None or date >= start:
                yield from open_source(f, self.fields).records()


@dataclass
class DatasetsSource:
    """Any Hugging Face `datasets` dataset with a date column: a hub name or a local builder."""

    name: str
    split: str = "train"
    fields: Fields = field(default_factory=Fields)
    data_files: str | list[str] | None = None

    def dates(self) -> None:
        return None

    def records(self, start: dt.date | None = None) -> Iterator[Record]:
        import datasets

        ds = datasets.load_dataset(self.name, data_files=self.data_files, split=self.split)
        if self.fields.date not in ds.column_names:
            raise StreamError(f"{self.name}[{self.split}]: field '{self.fields.date}': no such column")
        for i, row in enumerate(ds.sort(self.fields.date)):
            yield to_document(row, self.fields, f"{self.name}[{self.split}]:{i}")


def open_source(spec: str | Path, fields: Fields | None = None) -> Source:
    """A source from a path (JSON Lines or News Crawl by its name, or a folder of per-day files) or
    `hf:NAME` for `datasets`."""
    fields = fields or Fields()
    if isinstance(spec, str) and spec.startswith("hf:"):
        return DatasetsSource(spec[3:], fields=fields)
    path = Path(spec)
    if path.is_dir():
        return DirectorySource(path, fields)
    if not path.is_file():
        raise FileNotFoundError(f"news source not found: {path}")
    if path.name.startswith("news-docs."):
        return NewsCrawlSource(path)
    return JsonlSource(path, fields)


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


def _make_day(date: dt.date, docs: list[Document], seed: int, skipped: int) -> Day:
    """A day from its documents: exact repeats of a text dropped, near-duplicates grouped (and kept
    in one split, else a copy of a test article could be memorized)."""
    seen, unique = set(), []
    for doc in docs:
        digest = hashlib.sha256(doc.text.strip().encode()).digest()
        if digest not in seen:
            seen.add(digest)
            unique.append(doc)
    labels = dedup.twin_groups([d.text for d in unique])
    groups = {d.id: unique[g].id for d, g in zip(unique, labels)}
    return Day(date, *split_day(unique, seed, groups=labels), skipped=skipped, duplicates=len(docs) - len(unique),
               groups=groups)


def _day_documents(source: Source, start: dt.date | None, end: dt.date | None,
                   on_error: Literal["raise", "skip"]) -> Iterator[tuple[dt.date, list[Document], int]]:
    """(date, documents, bad records skipped) of each day from start to end, in date order."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    date, docs, skipped, last = None, [], 0, None
    for rec in source.records(start):
        if isinstance(rec, BadRecord):
            if on_error == "raise":
                raise StreamError(str(rec))
            skipped += 1
            continue
        where, doc = rec
        if last is not None and doc.date < last:
            raise StreamError(
                f"{where}: field 'date': {doc.date} comes after {last}; "
                "monim reads a stream day by day and needs the source sorted by date"
            )
        last = doc.date
        if start is not None and doc.date < start:
            skipped = 0
            continue
        if end is not None and doc.date > end:
            break
        if doc.date != date:
            if docs:
                yield date, docs, skipped
                skipped = 0
            date, docs = doc.date, []
        docs.append(doc)
    if docs:
        yield date, docs, skipped


def iter_days(
    source: Source,
    start: dt.date | None = None,
    end: dt.date | None = None,
    seed: int = 0,
    on_error: Literal["raise", "skip"] = "raise",
) -> Iterator[Day]:
    """The source's days from `start` to `end` (inclusive), in date order, one day in memory.

    Sources must be sorted by date. A bad record raises StreamError, or with on_error="skip" is
    skipped and counted in the `skipped` of the day being read when it was met. A text repeated
    within a day is kept once (counted in `duplicates`); near-duplicates are grouped (`groups`).
    """
    for date, docs, skipped in _day_documents(source, start, end, on_error):
        yield _make_day(date, docs, seed, skipped)


def read_day(source: str | Path, date: dt.date, seed: int = 0, on_error: Literal["raise", "skip"] = "raise") -> Day | None:
    """One day of a source, or None when it has no articles that day."""
    return next(iter_days(open_source(source), start=date, end=date, seed=seed, on_error=on_error), None)


def list_dates(source: str | Path, start: dt.date | None = None, end: dt.date | None = None,
               on_error: Literal["raise", "skip"] = "raise") -> list[dt.date]:
    """The dates between start and end (inclusive) on which the source has articles."""
    src = open_source(source)
    known = src.dates()
    if known is not None:
        return [d for d in known if (start is None or d >= start) and (end is None or d <= end)]
    return [date for date, _, _ in _day_documents(src, start, end, on_error)]
