"""Where news records come from: JSON Lines (plain or .gz), WMT News Crawl, a folder of per-day
files, or any `datasets` dataset; each record becomes a Document or a BadRecord naming the file,
line and field that is wrong.

A Document's id, title and text are strings UTF-8 can hold, without NUL characters: whatever a
record holds (any JSON value in any field, a lone surrogate from a `\\ud800` escape, nesting
deeper than MAX_DEPTH), it is read as one or refused as a BadRecord here, never later."""

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
from monim.core.text import json_depth, lone_surrogate
from monim.data.dayindex import BOM, IndexedFile, open_text


class StreamError(ValueError):
    """A bad record in a feed; the message names file, line and field."""


# Caps at ingest, so that one record cannot blow up a day's memory or a generation's `sources`:
TITLE_CAP = 300  # characters of a headline kept (and shown)
TEXT_CAP = 1_000_000  # characters of an article kept, before the token cap (max_article_tokens) cuts it further
ID_CAP = 256  # characters of an id; a longer one is a bad record (an id is never cut: two cut ids could collide)
MAX_DEPTH = 100  # arrays and objects a JSON record may nest (an article nests 2 or 3); deeper is a bad record


def clip(text: str, cap: int = 60) -> str:
    """A text cut to `cap` characters, an ellipsis marking the cut (a value quoted in a message)."""
    return text if len(text) <= cap else text[: cap - 1] + "…"


def short_title(title: str) -> str:
    """The headline cut to TITLE_CAP characters, an ellipsis marking the cut."""
    return clip(title, TITLE_CAP)


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


class Feed(Protocol):
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
        raise ValueError(f"expected a date string, got {shown(value)}")
    text = value.strip()
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).date()


def shown(value: Any) -> str:
    """A record's value as JSON writes it (ASCII: a lone surrogate escaped), cut for a message."""
    try:
        return clip(json.dumps(value))
    except (TypeError, ValueError, RecursionError):  # not a JSON value (a `datasets` row's date, say)
        return clip(ascii(value))


def not_text(value: str) -> str | None:
    """What makes a string unfit to keep, or None: a lone surrogate (UTF-8 cannot write it; a `\\ud800`
    escape makes one) or a NUL character (binary or corrupted data, never news)."""
    if (at := lone_surrogate(value)) is not None:
        return f"a lone surrogate (U+{ord(value[at]):04X}) at character {at + 1}: not text UTF-8 can hold"
    if (at := value.find("\x00")) >= 0:
        return f"a NUL character at character {at + 1}: binary or corrupted data, not text"
    return None


def _string(row: dict, name: str, where: str, date: dt.date | None, numbers: bool = False) -> str | None | BadRecord:
    """A field's string (None where it is missing or null), or a BadRecord naming the field; `numbers`:
    an integer is its decimal digits (an id)."""
    value = row.get(name)
    if value is None:
        return None
    if numbers and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return BadRecord(where, name, f"expected a string{' or an integer' if numbers else ''}, got {shown(value)}", date)
    problem = not_text(value)
    return value if problem is None else BadRecord(where, name, problem, date)


def to_document(row: dict, fields: Fields, where: str) -> Record:
    """A Document from one record's fields, or a BadRecord saying which field is wrong."""
    if fields.date not in row or row[fields.date] is None or row[fields.date] == "":
        return BadRecord(where, fields.date, "missing")
    try:
        date = parse_date(value := row[fields.date])
    except ValueError as e:
        return BadRecord(where, fields.date, f"unparsable date {shown(value)} ({clip(str(e))})" if isinstance(value, str)
                         else str(e))
    text = _string(row, fields.text, where, date)
    if isinstance(text, BadRecord):
        return text
    if text is None or not text.strip():
        return BadRecord(where, fields.text, "missing or empty text", date)
    doc_id = _string(row, fields.id, where, date, numbers=True)
    if isinstance(doc_id, BadRecord):
        return doc_id
    if not doc_id:
        if fields.missing_id != "hash":
            return BadRecord(where, fields.id, "missing (say how to name records without one: missing_id=\"hash\", "
                                               "`--missing-id hash`)", date)
        doc_id = "h" + hashlib.sha256(f"{date}\n{text}".encode()).hexdigest()[:16]
    if len(doc_id) > ID_CAP:
        return BadRecord(where, fields.id, f"{len(doc_id):,} characters, more than the {ID_CAP} an id may have", date)
    title = _string(row, fields.title, where, date)
    if isinstance(title, BadRecord):
        return title
    title = (title or "").strip()
    cut = tuple(name for name, value, cap in (("title", title, TITLE_CAP), ("text", text, TEXT_CAP)) if len(value) > cap)
    return where, Document(id=doc_id, date=date, text=text[:TEXT_CAP], title=short_title(title), cut=cut)


def _decode(raw: bytes, where: str, field: str | None) -> str | BadRecord:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRecord(where, field, f"not valid UTF-8 (byte {e.start}: {e.reason})")


@dataclass
class JsonlFeed(IndexedFile):
    """JSON Lines, plain or .gz, one article per line with a date and a text field."""

    path: Path
    fields: Fields = field(default_factory=Fields)

    def record(self, raw: bytes, where: str) -> Record:
        """One line's Document, or a BadRecord naming what is wrong with it."""
        line = _decode(raw, where, None)
        if isinstance(line, BadRecord):
            return line
        if _too_deep(line):
            return BadRecord(where, None, f"malformed JSON (nested more than {MAX_DEPTH} deep)")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return BadRecord(where, None, f"malformed JSON ({e.msg} at column {e.colno})")
        except ValueError as e:  # an integer of more digits than Python converts
            return BadRecord(where, None, f"malformed JSON ({clip(str(e), 100)})")
        if not isinstance(row, dict):
            return BadRecord(where, None, f"expected a JSON object, got {type(row).__name__}")
        return to_document(row, self.fields, where)

    def date_of(self, raw: bytes) -> dt.date | None:
        rec = self.record(raw, "")
        return rec.date if isinstance(rec, BadRecord) else rec[1].date

    def records(self, start: dt.date | None = None) -> Iterator[Record]:
        for where, raw in self.lines(start):
            yield self.record(raw, where)


def _too_deep(line: str) -> bool:
    """Whether a JSON line nests deeper than MAX_DEPTH (a bad record, not the RecursionError json would raise)."""
    return line.count("[") + line.count("{") > MAX_DEPTH and json_depth(line) > MAX_DEPTH


@dataclass
class NewsCrawlFeed(IndexedFile):
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
class DirectoryFeed:
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
                for rec in open_feed(f, self.fields).records():  # a record without a readable date: its file's day
                    yield replace(rec, date=date) if isinstance(rec, BadRecord) and rec.date is None else rec


@dataclass
class DatasetsFeed:
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


def open_feed(source: str | Path, fields: Fields | None = None) -> Feed:
    """A feed from a path (JSON Lines or News Crawl by its name, or a folder of per-day files) or
    `hf:NAME` for `datasets`."""
    fields = fields or Fields()
    if isinstance(source, str) and source.startswith("hf:"):
        return DatasetsFeed(source[3:], fields=fields)
    path = Path(source)
    if path.is_dir():
        return DirectoryFeed(path, fields)
    if not path.is_file():
        raise FileNotFoundError(f"news source not found: {path}")
    if path.name.startswith("news-docs."):
        return NewsCrawlFeed(path)
    with open_text(path) as f:
        if f.read(64).removeprefix(BOM).lstrip().startswith(b"["):
            raise StreamError(f"{path}: line 1: a JSON array; monim reads JSON Lines, one object per line (convert "
                              f"it with: jq -c '.[]' {path.name} > {path.stem}.jsonl)")
    return JsonlFeed(path, fields)


