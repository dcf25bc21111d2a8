"""Every record of a feed counted once (issue 57): feeds built to be awkward (bad records at a day's
start, middle and end, days of bad records only, late records, ids met twice or known to a memory from
another day, a bad record after the range) and random ones (Hypothesis), read whole and day by day as
a run reads them. The reference is the feed itself: its lines."""

import datetime as dt
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from monim.data.sources import StreamError, open_source
from monim.data.stream import check_records, iter_days, read_day, records

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
    return {d.date.isoformat(): d.counts() for d in iter_days(open_source(path), on_error="skip", known=known)}


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_awkward_feeds_count_every_record_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    lines = [UNDATED, good("a", 0), dated_bad(0), good("b", 0), dated_bad(0), dated_bad(0),  # bad at start, middle, end
             UNDATED, dated_bad(1), dated_bad(1),  # a day of bad records only: counted with the next day learned
             good("c", 2), good("a", 2), good("k", 2),  # an id met twice; one a memory learned on another day
             good("d", 3), good("late", 1), UNDATED, good("e", 3), good("f", 4), UNDATED]
    path = write(tmp_path / "feed.jsonl", lines)
    known = {"k": ("2022-05-30", "memories/fullmem learned")}
    for counts in (by_day(path, known=known), whole(path, known)):
        assert sum(c["records"] for c in counts.values()) == len(lines)
        assert [(d, c["train"] + c["validation"] + c["test"], c["skipped"], c["late"]) for d, c in counts.items()] == [
            ("2022-06-01", 2, 4, 0), ("2022-06-03", 1, 5, 0), ("2022-06-04", 2, 1, 1), ("2022-06-05", 1, 1, 0)]
    with pytest.raises(StreamError, match=r"feed.jsonl:12: field 'id': 'k' again: memories/fullmem learned an article "
                                          r"of 2022-05-30"):
        read_day(path, dt.date(2022, 6, 3), known=known, on_error="raise", since=dt.date(2022, 6, 3))


def test_a_bad_record_beyond_the_range_refuses_nothing(tmp_path, monkeypatch):
    """A per-day folder whose next day repeats an id (issue 57, case 6): the range before it is clean."""
    monkeypatch.setenv("MONIM_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "feed"
    folder.mkdir()
    write(folder / "2022-06-01.jsonl", [good("a", 0), good("b", 0)])
    write(folder / "2022-06-02.jsonl", [good("c", 1), good("a", 1)])
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
