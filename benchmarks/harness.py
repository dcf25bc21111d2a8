"""What the benchmarks share: where things are (the repository, the shared data, the results), a
benchmark's command line, its result JSON (written atomically, read back to resume), a monim
command's JSON, the served model's requests and the news days a small study reads. Every benchmark
imports it (`from harness import ...`: a benchmark runs as `python benchmarks/<name>.py`)."""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from monim.core.atomic import replacing  # the standard library only: gpu.py runs where FAISS, Prefect and MLflow are not
from monim.core.environment import set_defaults

if TYPE_CHECKING:
    from monim.data.day import Day

set_defaults()  # a benchmark is an entry point: `from harness import ...` comes before torch, Prefect or MLflow
REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MONIM_DATA", REPO.parent / "shared" / "data"))  # as the tests read it
RTQA = DATA / "news" / "realtimeqa-2022-06-to-09.jsonl.gz"
QUIZ = DATA / "qa" / "realtimeqa-quiz-2022-06-to-09.jsonl"
REUTERS = DATA / "news" / "reuters21578.jsonl.gz"
RESULTS = REPO / "benchmarks" / "results"
MONIM = str(Path(sys.executable).parent / "monim")


def parser(doc: str, name: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring as the help and, for a benchmark `name`, --out (its
    result JSON in benchmarks/results)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if name:
        ap.add_argument("--out", type=Path, default=RESULTS / f"{name}.json", help="The result JSON.")
    return ap


def news_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """A study over the first news days: the stream, its first day, how many days, articles a day, the LM."""
    ap = parser(doc, name)
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--days", type=int, default=10)
    ap.add_argument("--max-docs", type=int, default=8)
    ap.add_argument("--model", default=None)
    return ap


def first_days(args: argparse.Namespace) -> list[Day]:
    """The first `args.days` days of the stream from `args.start`."""
    from monim.data.feed import open_feed
    from monim.data.stream import iter_days

    return list(itertools.islice(iter_days(open_feed(args.source), start=args.start), args.days))


def resume(path: Path, empty: dict | list) -> dict | list:
    """The result JSON written so far (a stopped benchmark resumes from it), else `empty`."""
    return json.loads(Path(path).read_text()) if Path(path).exists() else empty


def save(path: Path, result: dict | list, default=None) -> None:
    """Write the result JSON atomically (a kill while writing keeps what was written before)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(result, indent=1, default=default))


def monim_json(*args: str) -> dict:
    """A monim command's last JSON line (it must succeed)."""
    out = subprocess.run([MONIM, *map(str, args), "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def requests_pool(n_texts: int, n_prompts: int, new_tokens: int) -> list[dict]:
    """Distinct requests to a served model from the demo stream's articles: texts of ~1,000 characters
    to score, and article openings to continue."""
    from monim.data.feed import open_feed
    from monim.core.config import DEMO_STREAM
    from monim.data.stream import iter_days

    docs = [d for day in iter_days(open_feed(DEMO_STREAM)) for d in day.train + day.test]
    texts = [{"dataframe_records": [{"text": d.text[:1000]}]} for d in docs[:n_texts]]
    prompts = [{"dataframe_records": [{"prompt": " ".join(d.text.split()[:12])}], "params": {"max_new_tokens": new_tokens}}
               for d in docs[n_texts : n_texts + n_prompts]]
    return [r for pair in zip(texts, prompts) for r in pair] + texts[len(prompts):] + prompts[len(texts):]
