"""News streams on the shared real data, the bundled demo, and every bad-input case."""

import base64
import datetime as dt
import gzip
import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from helpers import write_feed
from monim.core.config import DEMO_STREAM
from monim.data.day import split_day
from monim.data.feed import DatasetsFeed, Document, StreamError, open_feed
from monim.data.stream import iter_days

D = dt.date


@pytest.mark.slow
def test_realtimeqa_has_every_day_of_june_to_september(data_dir):
    days = list(iter_days(open_feed(data_dir / "news" / "realtimeqa-2022-06-to-09.jsonl.gz")))
    assert len(days) == 30 + 31 + 31 + 30
    assert [d.date for d in days] == sorted(d.date for d in days)
    assert sum(len(d) + d.duplicates for d in days) == 3160
    assert days[0].duplicates == 1  # 2022-06-01 has one article twice, under two URLs
    for d in days:  # RealTime QA days are small: one held-out article each, or one near-duplicate group
        for split in (d.validation, d.test):
            assert len({d.groups[doc.id] for doc in split}) == 1 and len(split) == sum(
                g == d.groups[split[0].id] for g in d.groups.values())
    assert sum(len(d.validation) + len(d.test) > 2 for d in days) == sum(
        d.twin_groups > 0 and len(d.validation) + len(d.test) > 2 for d in days) > 0


@pytest.mark.slow
def test_reuters_day_counts_and_proportions(data_dir):
    days = list(iter_days(open_feed(data_dir / "news" / "reuters21578.jsonl.gz")))
    assert len(days) == 58 and sum(len(d) + d.duplicates for d in days) == 16934
    day = next(d for d in days if d.date == D(1987, 3, 2))
    assert day.duplicates == 3 and (len(day.train), len(day.validation), len(day.test)) == (467, 5, 5)  # 477: 1% each


def test_date_range_and_bundled_demo():
    days = list(iter_days(open_feed(DEMO_STREAM), start=D(1987, 3, 4), end=D(1987, 3, 9)))
    assert [d.date.day for d in days] == [4, 5, 6, 7, 9]
    assert sum(len(d) + d.duplicates for d in iter_days(open_feed(DEMO_STREAM))) == 4003
    assert (DEMO_STREAM.parent / "NOTICE.md").read_text().count("research purposes only") == 1


def test_split_is_deterministic_seeded_and_disjoint():
    docs = [Document(f"doc-{i}", D(2022, 1, 1), "x") for i in range(300)]
    a, b = split_day(docs, seed=0), split_day(list(reversed(docs)), seed=0)
    assert [{d.id for d in s} for s in a] == [{d.id for d in s} for s in b]  # order-independent
    c = split_day(docs, seed=1)
    assert {d.id for d in a[2]} != {d.id for d in c[2]}
    assert [len(s) for s in a] == [294, 3, 3]
    assert Counter(d.id for s in a for d in s) == Counter(d.id for d in docs)
    assert [len(s) for s in split_day(docs[:2])] == [2, 0, 0]
    assert [len(s) for s in split_day(docs[:3])] == [1, 1, 1]



GOOD = [json.dumps({"id": str(i), "date": "2022-06-0%d" % (1 + i // 2), "text": f"story {i}"}).encode() for i in range(6)]
BAD = {
    "malformed JSON": (b'{"id": "x", "date": "2022-06-01", "text": ', None),
    "missing": (json.dumps({"id": "x", "text": "t"}).encode(), "date"),
    "unparsable date": (json.dumps({"id": "x", "date": "June 1st", "text": "t"}).encode(), "date"),
    "not valid UTF-8": (b'{"id": "x", "date": "2022-06-01", "text": "caf\xe9"}', None),
    "missing or empty text": (json.dumps({"id": "x", "date": "2022-06-01", "text": "  "}).encode(), "text"),
}


def test_repeated_texts_within_a_day_count_once(tmp_path):
    rows = [{"id": "a", "date": "2022-06-01", "text": "Same story."}, {"id": "b", "date": "2022-06-01", "text": "Same story.\n"},
            {"id": "c", "date": "2022-06-01", "text": "Other story."}, {"id": "d", "date": "2022-06-02", "text": "Same story."}]
    path = write_feed(tmp_path / "news.jsonl.gz", rows)
    days = list(iter_days(open_feed(path)))
    assert [(len(d), d.duplicates) for d in days] == [(2, 1), (1, 0)]  # across days a repeat is news again
    assert {d.id for d in days[0].train} == {"a", "c"}


@pytest.mark.parametrize("problem", BAD)
def test_bad_record_names_file_line_and_field(problem, tmp_path):
    raw, field = BAD[problem]
    path = write_feed(tmp_path / "news.jsonl.gz", GOOD[:3] + [raw] + GOOD[3:])
    with pytest.raises(StreamError) as err:
        list(iter_days(open_feed(path)))
    msg = str(err.value)
    assert f"{path}:4:" in msg and problem in msg
    assert (f"field '{field}'" in msg) if field else ("field" not in msg)


def test_bad_records_are_skipped_and_counted(tmp_path):
    path = write_feed(tmp_path / "news.jsonl.gz", GOOD[:3] + [raw for raw, _ in BAD.values()] + GOOD[3:])
    days = list(iter_days(open_feed(path), on_error="skip"))
    assert [len(d) for d in days] == [2, 2, 2]
    assert [d.skipped for d in days] == [0, 5, 0]  # met while reading 2022-06-02


def test_a_bad_record_between_two_days_counts_once_read_whole_or_day_by_day(tmp_path):
    from monim.data.stream import list_dates, read_day

    path = write_feed(tmp_path / "news.jsonl.gz", GOOD[:2] + [BAD["malformed JSON"][0]] + GOOD[2:] + [b"{end"])
    whole = [d.skipped for d in iter_days(open_feed(path), on_error="skip")]
    one_by_one = [read_day(path, d, on_error="skip").skipped for d in list_dates(path, on_error="skip")]
    assert whole == one_by_one == [1, 0, 1]  # between two days: the day above's (being read); at the end: the last day's


def test_a_record_out_of_date_order_is_named_late_not_learned_and_blocks_nothing(tmp_path):
    path = write_feed(tmp_path / "news.jsonl.gz", [GOOD[4], GOOD[0]])
    (day,) = list(iter_days(open_feed(path)))  # on_error="raise": late news is no error
    assert day.date == D(2022, 6, 3) and len(day) == 1 and day.late == [("0", "2022-06-01")]


def test_a_late_record_is_skipped_counted_and_named_in_the_day_it_follows(tmp_path):
    from monim.data.stream import list_dates, read_day

    late = [json.dumps({"id": f"late-{d}", "date": f"2022-06-0{d}", "text": f"filed late {d}"}).encode() for d in (1, 2)]
    path = write_feed(tmp_path / "news.jsonl.gz", GOOD[:4] + [BAD["malformed JSON"][0], late[0]] + GOOD[4:] + [late[1]])
    with pytest.raises(StreamError, match=r"news.jsonl.gz:5: malformed JSON"):
        list_dates(path)
    whole = list(iter_days(open_feed(path), on_error="skip"))
    one_by_one = [read_day(path, d, on_error="skip") for d in list_dates(path, on_error="skip")]
    for days in (whole, one_by_one):  # neither blocked: counted once, in the day whose records they follow
        assert [d.date for d in days] == [D(2022, 6, 1), D(2022, 6, 2), D(2022, 6, 3)]
        assert [d.late for d in days] == [[], [("late-1", "2022-06-01")], [("late-2", "2022-06-02")]]
        assert [(d.counts()["late"], d.skipped, len(d)) for d in days] == [(0, 0, 2), (1, 1, 2), (1, 0, 2)]
    strict = list(iter_days(open_feed(write_feed(tmp_path / "raise.jsonl.gz", GOOD[:4] + [late[0]] + GOOD[4:]))))
    assert [d.late for d in strict] == [[], [("late-1", "2022-06-01")], []]  # on_error="raise" too: no block


def test_missing_source_file():
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        open_feed("/nowhere.jsonl")


def test_custom_field_names_and_plain_jsonl(tmp_path):
    from monim.data.feed import Fields

    path = tmp_path / "feed.jsonl"
    path.write_text('{"published": "2022-06-01T08:30:00Z", "body": "Rates rose."}\n')
    with pytest.raises(StreamError, match=r"feed.jsonl:1: field 'id': missing"):
        list(iter_days(open_feed(path, Fields(date="published", text="body"))))
    (day,) = iter_days(open_feed(path, Fields(date="published", text="body", missing_id="hash")))
    assert day.date == D(2022, 6, 1) and day.train[0].text == "Rates rose."
    copy = tmp_path / "elsewhere.jsonl"  # the id is the record's, whatever the file is called
    copy.write_text(path.read_text())
    (again,) = iter_days(open_feed(copy, Fields(date="published", text="body", missing_id="hash")))
    assert day.train[0].id == again.train[0].id and day.train[0].id.startswith("h")


def test_an_id_met_twice_is_refused_naming_both_lines_or_skipped(tmp_path):
    rows = [{"id": "a", "date": "2022-06-01", "text": "One."}, {"id": "b", "date": "2022-06-01", "text": "Two."},
            {"id": "a", "date": "2022-06-01", "text": "Three, under one's id."}]
    path = tmp_path / "feed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(StreamError, match=rf"feed.jsonl:3: field 'id': 'a' again: {path}:1 has the same id"):
        list(iter_days(open_feed(path)))
    (day,) = iter_days(open_feed(path), on_error="skip")
    assert sorted(d.text for d in day.train + day.validation + day.test) == ["One.", "Two."] and day.skipped == 1


def test_a_record_dated_after_today_is_refused_or_skipped(tmp_path):
    from monim.data.stream import list_dates, read_day

    future = dt.date.today() + dt.timedelta(days=30)
    rows = [{"id": "a", "date": "2022-06-01", "text": "One."}, {"id": "b", "date": future.isoformat(), "text": "Later."}]
    path = tmp_path / "feed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(StreamError, match=rf"1 day\(s\) after today .*from {future}"):
        list_dates(path)
    assert list_dates(path, on_error="skip") == [D(2022, 6, 1)]
    with pytest.raises(StreamError, match=rf"feed.jsonl:2: field 'date': {future} is after today"):
        read_day(path, future)


def test_a_bom_is_read_and_a_json_array_refused_saying_so(tmp_path):
    path = tmp_path / "feed.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "date": "2022-06-01", "text": "One."}).encode() + b"\n")
    (day,) = iter_days(open_feed(path))
    assert day.train[0].text == "One."
    array = tmp_path / "feed.json"
    array.write_text(json.dumps([{"id": "a", "date": "2022-06-01", "text": "One."}]))
    with pytest.raises(StreamError, match=r"feed.json: line 1: a JSON array; monim reads JSON Lines.*jq -c"):
        open_feed(array)


def test_a_long_article_is_cut_to_the_token_cap_and_counted(tmp_path):
    from monim.data.day import Day

    long, short = Document("l", D(2022, 6, 1), "word " * 50), Document("s", D(2022, 6, 1), "a few words")
    cut = lambda text, n: " ".join(text.split()[:n]) if len(text.split()) > n else None  # noqa: E731  (n words)
    day = Day(D(2022, 6, 1), [short], [long], []).truncate(10, cut)
    assert day.validation[0].text == " ".join(["word"] * 10) and day.train == [short]
    assert day.counts()["truncated"] == 1


def test_titles_and_texts_are_capped_at_ingest_and_counted_and_a_long_id_refused(tmp_path):
    from monim.data.feed import ID_CAP, TEXT_CAP, TITLE_CAP, short_title

    rows = [{"id": "big", "date": "2022-06-01", "title": "T" * 1_000_000, "text": "x" * (TEXT_CAP + 5)},
            {"id": "ok", "date": "2022-06-01", "title": " Short ", "text": "fine"},
            {"id": "i" * (ID_CAP + 1), "date": "2022-06-01", "text": "an id too long to keep"}]
    path = tmp_path / "feed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(StreamError, match=rf"feed.jsonl:3: field 'id': {ID_CAP + 1} characters"):
        list(iter_days(open_feed(path)))
    (day,) = iter_days(open_feed(path), on_error="skip")
    docs = {d.id: d for d in day.train + day.validation + day.test}
    assert len(docs["big"].title) == TITLE_CAP and docs["big"].title.endswith("T…") and len(docs["big"].text) == TEXT_CAP
    assert (docs["ok"].title, docs["ok"].text) == ("Short", "fine")
    assert (day.counts()["titles_cut"], day.counts()["texts_cut"], day.skipped) == (1, 1, 1)
    assert short_title("a" * TITLE_CAP) == "a" * TITLE_CAP and short_title(docs["big"].title) == docs["big"].title


def test_articles_added_to_a_learned_day_are_named(tmp_path, monkeypatch):
    from monim.data.stream import arrived_after, read_day

    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "feed.jsonl"
    _write_days(path, [("2022-06-01", 3), ("2022-06-02", 4)])
    learned = read_day(path, D(2022, 6, 2)).counts()
    assert arrived_after(path, D(2022, 6, 2), learned["records"]) == []
    with open(path, "a") as f:  # a story filed late, in date order; then one out of it, and a broken line
        f.write(json.dumps({"id": "wire", "date": "2022-06-02", "text": "Filed late."}) + "\n")
        f.write(json.dumps({"id": "older", "date": "2022-06-01", "text": "Older still."}) + "\n")
        f.write("{broken\n")
    found = arrived_after(path, D(2022, 6, 2), learned["records"], on_error="skip")
    assert found == [("wire", "2022-06-02"), ("older", "2022-06-01"),
                     (f"{path}:10: malformed JSON (Expecting property name enclosed in double quotes at column 2)", "")]
    assert arrived_after(path, D(2022, 6, 1), 3, on_error="skip") == []


def test_a_feed_past_its_lag_has_stalled(tmp_path):
    from monim.data.stream import FeedStalled, check_feed

    path = tmp_path / "feed.jsonl"
    _write_days(path, [("2022-06-01", 2), ("2022-06-03", 1)])
    assert check_feed(path, D(2022, 6, 4), max_lag=1) == D(2022, 6, 3)
    with pytest.raises(FeedStalled, match=rf"{path}: the feed has stalled: its last article is dated 2022-06-03, 2 "
                                          r"days before 2022-06-05"):
        check_feed(path, D(2022, 6, 5), max_lag=1)


def test_news_crawl_docs_format(tmp_path):
    b64 = lambda s: base64.b64encode(s.encode())  # noqa: E731
    path = write_feed(tmp_path / "news-docs.2020.en.filtered.gz", [
        b"20200101\t" + b64("A.\nB.") + b"\t" + b64("A. B."),
        b"20200102\t" + b64("C.") + b"\t" + b64("C, in full."),
        b"20200102\tx\t!!notbase64",
    ])
    days = list(iter_days(open_feed(path), on_error="skip"))
    assert [(d.date, [x.text for x in d.train]) for d in days] == [(D(2020, 1, 1), ["A. B."]), (D(2020, 1, 2), ["C, in full."])]
    assert days[1].skipped == 1
    with pytest.raises(StreamError, match=r":3: field 'text': invalid base64"):
        list(iter_days(open_feed(path)))


def test_datasets_source_on_local_files(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"id": "l", "date": "2022-06-02", "text": "later"}, {"id": "e", "date": "2022-06-01", "text": "earlier"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    days = list(iter_days(DatasetsFeed("json", data_files=str(path))))  # sorted by its date column
    assert [(d.date, d.train[0].text) for d in days] == [(D(2022, 6, 1), "earlier"), (D(2022, 6, 2), "later")]


def _write_days(path, days, opener=open):
    with opener(path, "wt") as f:
        for date, n in days:
            for i in range(n):
                f.write(json.dumps({"id": f"{date}-{i}", "date": date, "text": f"Story {i} of {date}."}) + "\n")


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_day_index_reads_only_the_day_and_follows_appends_and_rewrites(suffix, tmp_path, monkeypatch):
    from monim.data.stream import list_dates, read_day

    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"news{suffix}"
    opener = gzip.open if suffix.endswith(".gz") else open
    _write_days(path, [("2022-06-01", 3), ("2022-06-02", 2), ("2022-06-04", 4)], opener)
    assert list_dates(path) == [D(2022, 6, 1), D(2022, 6, 2), D(2022, 6, 4)]
    day = read_day(path, D(2022, 6, 4))
    assert sorted(d.id for d in (*day.train, *day.validation, *day.test)) == [f"2022-06-04-{i}" for i in range(4)]
    assert read_day(path, D(2022, 6, 3)) is None and read_day(path, D(2022, 6, 9)) is None
    # appended: the index is rebuilt, the new day found
    with opener(path, "at") as f:
        f.write(json.dumps({"id": "late", "date": "2022-06-05", "text": "A late story."}) + "\n")
        f.write("{not json\n")
    assert list_dates(path)[-1] == D(2022, 6, 5)
    with pytest.raises(StreamError, match=rf"{path.name}:11: malformed JSON"):
        read_day(path, D(2022, 6, 5))
    # rewritten (other days): the old offsets are not trusted
    _write_days(path, [("2022-07-01", 1), ("2022-07-02", 2)], opener)
    assert list_dates(path) == [D(2022, 7, 1), D(2022, 7, 2)]
    assert [d.id for d in read_day(path, D(2022, 7, 2)).train + read_day(path, D(2022, 7, 2)).test] != []


def test_a_day_read_opens_the_file_once_from_that_day(tmp_path, monkeypatch):
    from monim.data import dayindex, feed
    from monim.data.stream import read_day

    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "news.jsonl"
    _write_days(path, [(f"2022-06-{d:02d}", 50) for d in range(1, 21)])
    read_day(path, D(2022, 6, 1))  # builds the index
    parsed = []
    real = feed.to_document
    monkeypatch.setattr(feed, "to_document", lambda row, fields, where: parsed.append(where) or real(row, fields, where))
    dayindex.READS.clear()
    day = read_day(path, D(2022, 6, 20))
    assert len(day) == 50 and dayindex.READS[str(path)] == 1
    assert len(parsed) == 50 and parsed[0] == f"{path}:951"  # the day's lines only, numbered as in the file


def test_directory_of_day_files_is_a_source(tmp_path, monkeypatch):
    from monim.data.stream import list_dates, read_day

    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "days"
    folder.mkdir()
    _write_days(folder / "2022-06-01.jsonl", [("2022-06-01", 3)])
    _write_days(folder / "2022-06-02.jsonl.gz", [("2022-06-02", 2)], gzip.open)
    (folder / "README.md").write_text("not a day")
    assert list_dates(folder) == [D(2022, 6, 1), D(2022, 6, 2)]
    assert len(read_day(folder, D(2022, 6, 2))) == 2


# Any JSON value, and any Unicode: lone surrogates (valid JSON as `\ud800`), NULs, control characters.
UNICODE = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | UNICODE | st.sampled_from(
    ["2022-06-01", "2022-06-01T08:30:00Z", "20220601", "", " ", "\ud800", "a\x00b", "9999-12-31", "0001-01-01"])
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(UNICODE, inner, max_size=3),
                    max_leaves=8)
FIELDS = ("date", "text", "id", "title")
LIKELY = {"date": st.sampled_from(["2022-06-01", "2022-06-02T23:59:59+05:00"]), "text": UNICODE.filter(str.strip),
          "id": UNICODE | st.integers(), "title": UNICODE}  # what a field of an article holds, mostly
MOSTLY = {f: st.integers(0, 4).flatmap(lambda k, f=f: JSON if k == 0 else LIKELY[f]) for f in FIELDS}  # 1 in 5: any JSON
ROWS = st.fixed_dictionaries({"date": MOSTLY["date"]}, optional={f: MOSTLY[f] for f in FIELDS[1:]})
RAW = st.sampled_from([  # lines json.dumps never writes
    b'{"id": "a", "date": "2022-06-01", "text": "an invalid \\x escape"}', b'{"id": "a", "date": "2022-06-01", "text": "\\ud8"}',
    b'{"id": "a", "date": "2022-06-01", "text": "\xed\xa0\x80"}',  # a surrogate encoded in UTF-8 bytes: not valid UTF-8
    b'{"id": "a", "date": "2022-06-01", "text": "ok", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"id": "a", "date": "2022-06-01", "text": "ok", "deep": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001,
    b'{"id": ' + b"9" * 5000 + b', "date": "2022-06-01", "text": "an id json cannot convert"}', b"[" * 200_000, b"\x00",
    b'"\\ud800"', b'{"id": "a", "date": "2022-06-01", "text": NaN}', b'\xff\xfe{\x00"\x00'])


def valid(rec, where: str) -> bool:
    """Whether a record is a valid Document at `where`, or a BadRecord at `where` naming a field of the
    record (or none: the line as a whole), its message printable."""
    from monim.data.feed import BadRecord

    if isinstance(rec, BadRecord):
        return rec.where == where and rec.field in (None, *FIELDS) and bool(str(rec).encode())
    return rec[0] == where and sound(rec[1])


def sound(doc: Document) -> bool:
    """Whether a Document's fields are what one promises: a date; id, title and text strings UTF-8 encodes,
    without NUL; a text with more than spaces; an id of 1 to ID_CAP characters; title and text within their caps."""
    from monim.data.feed import ID_CAP, TEXT_CAP, TITLE_CAP

    texts = (doc.id, doc.title, doc.text)
    return (isinstance(doc.date, dt.date) and all(isinstance(t, str) and "\x00" not in t for t in texts)
            and all(t.encode("utf-8", "strict") is not None for t in texts) and doc.text.strip() != ""
            and 0 < len(doc.id) <= ID_CAP and len(doc.title) <= TITLE_CAP and len(doc.text) <= TEXT_CAP)


@settings(max_examples=300, deadline=None)
@given(ROWS, st.sampled_from(["error", "hash"]))
def test_any_record_is_a_valid_document_or_a_bad_record_naming_its_field(row, missing_id):
    from monim.data.feed import Fields, to_document

    rec = to_document(row, Fields(missing_id=missing_id), "feed.jsonl:7")
    event("a Document" if isinstance(rec, tuple) else f"bad: {rec.field}")
    assert valid(to_document(row, Fields(missing_id=missing_id), "feed.jsonl:7"), "feed.jsonl:7")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ROWS.map(lambda r: json.dumps(r).encode()) | RAW, min_size=1, max_size=6))
def test_any_line_of_a_feed_is_a_document_or_a_bad_record_naming_its_line_and_field(tmp_path_factory, lines):
    """Written to a file (json.dumps escapes a lone surrogate as `\\ud800`, as a feed would hold it): each line is
    read as a valid Document or a BadRecord naming its file:line, its date for the day index is the record's,
    and the stream skips and counts what is bad (nothing raises)."""
    from monim.data.feed import BadRecord, JsonlFeed

    path = tmp_path_factory.mktemp("feed") / "feed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    source = JsonlFeed(path)
    got = list(source.records())
    nonblank = [n for n, raw in enumerate(lines, 1) if raw.strip()]
    assert len(got) == len(nonblank)
    for n, raw, rec in zip(nonblank, [lines[n - 1] for n in nonblank], got):
        assert valid(rec, f"{path}:{n}"), rec
        assert source.date_of(raw) == (rec.date if isinstance(rec, BadRecord) else rec[1].date)
    for day in iter_days(source, on_error="skip"):
        assert all(sound(d) for s in (day.train, day.validation, day.test) for d in s)
