"""Every record of a feed counted once (issue 57): feeds built to be awkward (bad records at a day's
start, middle and end, days of bad records only, late records, ids met twice or known to a memory from
another day, a bad record after the range) and random ones (Hypothesis), read whole and day by day as
a run reads them. The reference is the feed itself: its lines."""

import datetime as dt
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import write_feed
from monim.data.day import records
from monim.data.feed import StreamError, open_feed
from monim.data.stream import check_records, iter_days, read_day

D0 = dt.date(2022, 6, 1)


def good(i: str, day: int) -> str:
    return json.dumps({"id": i, "date": (D0 + dt.timedelta(days=day)).isoformat(), "text": f"story {i} of day {day}"})


def dated_bad(day: int) -> str:
    return json.dumps({"id": "bad", "date": (D0 + dt.timedelta(days=day)).isoformat(), "text": " "})  # no text


UNDATED = '{"id": "x", "date": "2022-06-01", "text": '  # malformed JSON: no readable date


def by_day(path: Path, on_error: str = "skip", known=None) -> dict[str, dict]:
    """The feed read as a run reads it: each day with articles alone, from the day after the previous one,
    the memory knowing the ids of the days before (as a memory learns them)."""
    known = dict(known or {})
    dates, out, since = check_records(path, on_error=on_error, known=known), {}, dt.date.min
    for date in dates:
        day = read_day(path, date, on_error=on_error, since=since, known=known)
        out[date.isoformat()] = day.counts()
        known |= {i: (date.isoformat(), "the memory learned") for i in day.ids}
        since = date + dt.timedelta(days=1)
    return out


def whole(path: Path, known=None) -> dict[str, dict]:
    return {d.date.isoformat(): d.counts() for d in iter_days(open_feed(path), on_error="skip", known=known)}



def test_awkward_feeds_count_every_record_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    lines = [UNDATED, good("a", 0), dated_bad(0), good("b", 0), dated_bad(0), dated_bad(0),  # bad at start, middle, end
             UNDATED, dated_bad(1), dated_bad(1),  # undated: the day above's; a day of bad records only: the next day's
             good("c", 2), good("a", 2), good("k", 2),  # an id met twice; one a memory learned on another day
             good("d", 3), good("late", 1), UNDATED, good("e", 3), good("f", 4), UNDATED]
    path = write_feed(tmp_path / "feed.jsonl", lines)
    known = {"k": ("2022-05-30", "memories/fullmem learned")}
    for counts in (by_day(path, known=known), whole(path, known)):
        assert sum(c["records"] for c in counts.values()) == len(lines)
        assert [(d, c["train"] + c["validation"] + c["test"], c["skipped"], c["late"]) for d, c in counts.items()] == [
            ("2022-06-01", 2, 5, 0), ("2022-06-03", 1, 4, 0), ("2022-06-04", 2, 1, 1), ("2022-06-05", 1, 1, 0)]
    with pytest.raises(StreamError, match=r"feed.jsonl:12: field 'id': 'k' again: memories/fullmem learned an article "
                                          r"of 2022-05-30"):
        read_day(path, dt.date(2022, 6, 3), known=known, on_error="raise", since=dt.date(2022, 6, 3))


def test_a_bad_record_beyond_the_range_refuses_nothing(tmp_path, monkeypatch):
    """A per-day folder whose next day repeats an id (issue 57, case 6): the range before it is clean."""
    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "feed"
    folder.mkdir()
    write_feed(folder / "2022-06-01.jsonl", [good("a", 0), good("b", 0)])
    write_feed(folder / "2022-06-02.jsonl", [good("c", 1), good("a", 1)])
    assert check_records(folder, end=D0) == [D0]
    with pytest.raises(StreamError, match=r"2022-06-02.jsonl:2: field 'id': 'a' again"):
        check_records(folder)


KINDS = st.sampled_from(["good", "good", "good", "undated", "dated_bad", "repeat", "late", "known"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(KINDS, st.integers(0, 1)), min_size=1, max_size=40), st.booleans())
def test_random_feeds_count_every_record_once_whole_or_day_by_day(tmp_path_factory, feed, gz):
    """Any feed: the days' counts add up to its lines (it ends with a good record, as a feed read up
    to a later day does), read whole or day by day; and reading a range refuses (on_error="raise")
    exactly where skipping counts a bad record in it."""
    import gzip
    import os

    folder = tmp_path_factory.mktemp("feed")
    os.environ["MONIM_CACHE"] = str(folder / "cache")
    day, lines, ids = 0, [], []
    for n, (kind, step) in enumerate(feed):
        day += step
        if kind == "good" or (kind in ("repeat", "late") and not ids):
            ids.append(f"g{n}")
            lines.append(good(ids[-1], day))
        elif kind == "undated":
            lines.append(UNDATED)
        elif kind == "dated_bad":
            lines.append(dated_bad(day))
        elif kind == "repeat":
            lines.append(good(ids[n % len(ids)], day))
        elif kind == "late":
            lines.append(good(f"late{n}", max(day - 1 - n % 3, 0) if day else 0))
        else:
            lines.append(good("k", day))
    lines.append(good("last", day + 1))
    path = folder / ("feed.jsonl.gz" if gz else "feed.jsonl")
    with (gzip.open(path, "wt") if gz else open(path, "w")) as f:
        f.write("\n".join(lines) + "\n")
    known = {"k": ("2000-01-01", "memories/x learned")}
    one, all_ = by_day(path, known=known), whole(path, known)
    assert one == all_
    assert sum(c["records"] for c in one.values()) == len(lines)
    learned = dict(known)
    for date, counts in one.items():  # a day alone, strict: refused exactly where a bad record counts for it
        prev = max((d for d in one if d < date), default=None)
        since = dt.date.fromisoformat(prev) + dt.timedelta(days=1) if prev else dt.date.min
        learned |= {i: (prev, "the memory learned") for i in (read_day(path, dt.date.fromisoformat(prev), on_error="skip",
                    since=dt.date.min, known=learned).ids if prev else ())}
        try:
            read_day(path, dt.date.fromisoformat(date), on_error="raise", since=since, known=learned)
            refused = False
        except StreamError:
            refused = True
        assert refused == (counts["skipped"] > 0), (date, counts)
    assert records(next(iter(one.values()))) == next(iter(one.values()))["records"]


def learn_as_it_comes(path: Path, batches: list[list[str]]) -> tuple[dict[str, dict], dict[str, list], set[str]]:
    """A feed appended a batch at a time, each new day read as the daily run reads it (from the day after the
    last one learned): every day's counts when learned, the records each learned day got after it was
    learned (read as `monim status --source` reads them), and the late articles named as days were learned."""
    from monim.plan import arrivals

    learned: dict[str, dict] = {}
    late: set[str] = set()
    for batch in batches:
        with open(path, "a") as f:
            f.write("".join(line + "\n" for line in batch))
        since = dt.date.fromisoformat(max(learned)) + dt.timedelta(days=1) if learned else dt.date.min
        for date in check_records(path, start=since, on_error="skip"):
            day = read_day(path, date, on_error="skip", since=since)
            learned[date.isoformat()], late = {f"docs_{k}": v for k, v in day.counts().items()}, late | {i for i, _ in day.late}
            since = date + dt.timedelta(days=1)
    return learned, arrivals(str(path), learned), late


def test_a_feed_appended_daily_counts_each_record_once(tmp_path, monkeypatch):
    """Issue 65: a trailing bad line of a day's batch was counted with that day when it was learned and again
    with the next day once the feed grew; a bad line leading the next batch counted nowhere."""
    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    batches = [[good("a", 0), good("b", 0), UNDATED],  # a trailing bad line
               [good("c", 1), UNDATED, dated_bad(1)],  # and one mid-day, and a dated bad one at the end
               [UNDATED, good("d", 2)],  # a bad line leading the batch: came after day 1 was learned
               [good("e", 3)]]
    learned, after, _ = learn_as_it_comes(tmp_path / "feed.jsonl", batches)
    assert {d: c["docs_records"] for d, c in learned.items()} == {"2022-06-01": 3, "2022-06-02": 3, "2022-06-03": 1,
                                                                  "2022-06-04": 1}
    assert {d: [name for name, _ in found] for d, found in after.items()} == {
        "2022-06-02": [f"{tmp_path / 'feed.jsonl'}:7: malformed JSON (Expecting value at column 43)"]}
    assert sum(c["docs_records"] for c in learned.values()) + sum(map(len, after.values())) == sum(map(len, batches))


def test_a_late_article_is_named_wherever_its_line_sits(tmp_path, monkeypatch):
    """Issue 65: a late article that came after its day was learned was named or not depending on where an
    earlier late one sat: in the day itself, or in a day before it with bad records only (folded into it)."""
    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    late = lambda i: good(i, 0)  # noqa: E731  (dated the first day, out of date order wherever it sits below)
    for n, first in enumerate([[dated_bad(1), late("early"), good("c", 2)],  # in a day of bad records only
                               [dated_bad(1), good("c", 2), late("early")]]):  # in the day learned
        path = tmp_path / f"feed{n}.jsonl"
        learned, after, _ = learn_as_it_comes(path, [[good("a", 0)], first, [late("wire")]])
        assert learned["2022-06-03"]["docs_late"] == 1 and learned["2022-06-03"]["docs_skipped"] == 1
        assert after == {"2022-06-03": [("wire", "2022-06-01")]}, n


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.sampled_from(["late", "undated", "dated_bad"]), max_size=3), min_size=2, max_size=5),
       st.randoms(use_true_random=False))
def test_random_feeds_appended_daily_count_every_record_once_and_name_every_late_article(tmp_path_factory, extras, rnd):
    """Each day's batch (its articles, and late, undated and dated bad lines anywhere among them), learned as
    it comes: the days' counts and what came after each learned day add up to the feed's lines, and every
    late article is named, in the day it was learned with or as one that came after its day."""
    import os

    folder = tmp_path_factory.mktemp("feed")
    os.environ["MONIM_CACHE"] = str(folder / "cache")
    batches, lates = [], []
    for day, more in enumerate(extras):
        batch = [good(f"{day}-{i}", day) for i in range(rnd.randint(1, 3))]
        for n, kind in enumerate(more if day else []):
            if kind == "late":
                lates.append(f"late-{day}-{n}")
            line = good(lates[-1], rnd.randint(0, day - 1)) if kind == "late" else UNDATED if kind == "undated" else dated_bad(day)
            batch.insert(rnd.randint(0, len(batch)), line)
        batches.append(batch)
    path = folder / "feed.jsonl"
    learned, after, named = learn_as_it_comes(path, batches)
    assert sum(c["docs_records"] for c in learned.values()) + sum(map(len, after.values())) == sum(map(len, batches))
    assert set(lates) <= named | {i for found in after.values() for i, _ in found}


def test_a_day_files_unreadable_lines_count_for_its_day_read_whole_or_day_by_day(tmp_path, monkeypatch):
    """A folder of day files: a line without a readable date counts for its file's day, wherever it sits."""
    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "feed"
    folder.mkdir()
    write_feed(folder / "2022-06-01.jsonl", [good("a", 0), UNDATED])
    write_feed(folder / "2022-06-02.jsonl", [UNDATED, UNDATED, good("b", 1)])
    for counts in (by_day(folder), whole(folder)):
        assert {d: (c["skipped"], c["records"]) for d, c in counts.items()} == {"2022-06-01": (1, 2), "2022-06-02": (2, 3)}
