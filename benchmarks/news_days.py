"""What the news-stream benchmarks share: their command-line options and the days they read."""

import argparse
import datetime as dt
import itertools
from pathlib import Path

from monim.sources import open_source
from monim.stream import Day, iter_days

REPO = Path(__file__).resolve().parents[1]
STREAM = REPO.parent / "shared" / "data" / "news" / "realtimeqa-2022-06-to-09.jsonl.gz"


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """Options: the stream, its first day, how many days, articles a day, the LM, the JSON output."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--source", type=Path, default=STREAM)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--days", type=int, default=10)
    ap.add_argument("--max-docs", type=int, default=8)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"{name}.json")
    return ap


def first_days(args: argparse.Namespace) -> list[Day]:
    """The first `args.days` days of the stream from `args.start`."""
    return list(itertools.islice(iter_days(open_source(args.source), start=args.start), args.days))
