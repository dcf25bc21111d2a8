"""Where news records come from: JSON Lines (plain or .gz), WMT News Crawl, a folder of per-day
files, or any `datasets` dataset; each record becomes a Document or a BadRecord naming the file,
line and field that is wrong."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Protocol

from monim.core.config import Fields
from monim.data.dayindex import BOM, IndexedFile, open_text


class StreamError(ValueError):
    """A bad record in a news source; the message names file, line and field."""


# Caps at ingest, so that one record cannot blow up a day's memory or a generation's `sources`:
TITLE_CAP = 300  # characters of a headline kept (and shown)
TEXT_CAP = 1_000_000  # characters of an article kept, before the token cap (max_article_tokens) cuts it further
ID_CAP = 256  # characters of an id; a longer one is a bad record (an id is never cut: two cut ids could collide)


def short_title(title: str) -> str:
    """The headline cut to TITLE_CAP characters, an ellipsis marking the cut."""
    return title if len(title) <= TITLE_CAP else title[: TITLE_CAP - 1] + "…"


@dataclass(frozen=True)
class Document:
    """One dated news article."""

    id: str
    date: dt.date
    text: str
    title: str = ""  # the headline, where the record has one (shown as a source of generated text)
    cut: tuple[str, ...] = ()  # the fields cut to their cap at ingest ("title", "text")


@dataclass(frozen=True)
class BadRecord:
    """A record that could not be read: where it is and what is wrong with it."""

    where: str
    field: str | None
    problem: str
    date: dt.date | None = None  # the record's date where it could be read (the day it counts for: monim.data.stream)

    def __str__(self) -> str:
        what = f"field '{self.field}': " if self.field else ""
        return f"{self.where}: {what}{self.problem}"


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
        return BadRecord(where, fields.text, "missing or empty text", date)
    doc_id, title = row.get(fields.id), row.get(fields.title)
    if doc_id in (None, ""):
        if fields.missing_id != "hash":
            return BadRecord(where, fields.id, "missing (say how to name records without one: missing_id=\"hash\", "
                                               "`--missing-id hash`)", date)
        doc_id = "h" + hashlib.sha256(f"{date}\n{text}".encode()).hexdigest()[:16]
    if len(doc_id := str(doc_id)) > ID_CAP:
        return BadRecord(where, fields.id, f"{len(doc_id):,} characters, more than the {ID_CAP} an id may have", date)
    title = title.strip() if isinstance(title, str) else ""
    cut = tuple(name for name, value, cap in (("title", title, TITLE_CAP), ("text", text, TEXT_CAP)) if len(value) > cap)
    return where, Document(id=doc_id, date=date, text=text[:TEXT_CAP], title=short_title(title), cut=cut)


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
        for where, raw in self.lines(start):
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
        for where, raw in self.lines(start):
            cols, dated = raw.split(b"\t"), self.date_of(raw)
            if len(cols) < 3:
                yield BadRecord(where, None, f"expected 3 tab-separated columns, got {len(cols)}", dated)
                continue
            date = _decode(cols[0], where, "date")
            if isinstance(date, BadRecord):
                yield date
                continue
            try:
                text = _decode(base64.b64decode(cols[2], validate=True), where, "text")
            except binascii.Error as e:
                yield BadRecord(where, "text", f"invalid base64 ({e})", dated)
                continue
            if isinstance(text, BadRecord):
                yield replace(text, date=dated)
                continue
            yield to_document({"date": date, "text": text}, Fields(missing_id="hash"), where)  # News Crawl has no ids


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
    with open_text(path) as f:
        if f.read(64).removeprefix(BOM).lstrip().startswith(b"["):
            raise StreamError(f"{path}: line 1: a JSON array; monim reads JSON Lines, one object per line (convert "
                              f"it with: jq -c '.[]' {path.name} > {path.stem}.jsonl)")
    return JsonlSource(path, fields)


