"""Full daily volume: a stream learned with EVERY training article by FullMem, RandMem (at that
day's MoNIM rate) and MoNIM-AMT, beside the bare LM; the LM runs once per article (feature store).

Per day: test PPL of each memory, entries, MemRate, wall time per stage. At the end: weekly test
PPL with each memory as of each week's end (the forgetting matrix), the WikiText probe every 7
days, and the QA quiz with the final memories. Resumable: the work directory keeps the memories,
the features and rows.json; a finished day is not redone (the suite is kept per date range).
Writes the report's tables to benchmarks/results/full-volume.md (--report: only that, from what is learned).
Usage: python benchmarks/full_volume.py --start 2022-06-01 --end 2022-06-30 [--workdir DIR] [--report]
"""

import argparse
import datetime as dt
import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import monim  # noqa: F401  (OMP_WAIT_POLICY before torch)
import numpy as np
from rich.console import Console

from monim.calibration import calibrate
from monim.calibrator import CalibratorConfig
from monim.evaluate import evaluate_many
from monim.suite import period_of, text_document
from monim.features import Features
from monim.lm import load_lm
from monim.memorize import memorize_day
from monim.memory import Memory
from monim.theta import Settings
from monim.catalogue import make_policy
from monim.qa import answer_questions, read_questions
from monim.scoring import ScoreConfig
from monim.stream import list_dates, read_day

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
POLICIES = ("monim-amt", "fullmem", "randmem")  # MoNIM first: RandMem stores at its rate of the day


@contextmanager
def timed(seconds: dict, stage: str) -> Iterator[None]:
    """Add the block's wall time to seconds[stage]."""
    started = time.perf_counter()
    yield
    seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - started


def learn_day(date: dt.date, args, features: Features, memories: dict[str, Memory]) -> dict:
    seconds: dict[str, float] = {}
    with timed(seconds, "read"):
        day = read_day(args.source, date)
    with timed(seconds, "featurize"):
        lm_tokens = sum(features.prepare(docs, f"{date}-{split}") for split, docs in
                        (("train", day.train), ("validation", day.validation), ("test", day.test)))
    row = {"date": date.isoformat(), "articles": len(day.train), "lm_tokens": lm_tokens, "runs": {}}
    for name, memory in memories.items():
        params = {"rate": row["runs"]["monim-amt"]["memrate_day"]} if name == "randmem" else {}
        with timed(seconds, f"memorize_{name}"):
            stats = memorize_day(memory, day, make_policy(name, **params), features)
        with timed(seconds, f"calibrate_{name}"):
            record = calibrate(memory, day, features)
        row["runs"][name] = {"tokens": stats.tokens_seen, "stored": stats.stored, "memrate_day": stats.memrate,
                             "entries": len(memory), "memrate": memory.ds.memrate, "lam": memory.interpolation.lam,
                             "fallback": memory.fallback, "nll": record.get("nll"), "search_s": stats.seconds.get("search")}
    with timed(seconds, "evaluate"):
        result = evaluate_many(features.lm, day.test, {"bare": None, **memories}, features, f"{date}-test")
    row["test_tokens"] = result["bare"]["tokens"]
    row["ppl_lm"] = result["bare"]["ppl_lm"]
    for name in memories:
        row["runs"][name] |= {k: result[name][k] for k in ("ppl", "ppl_novel", "ppl_lm_novel", "twin_share", "accuracy")}
    row["seconds"] = seconds
    return row


def suite(args, features: Features, memories: dict[str, Memory], dates: list[dt.date]) -> dict:
    """Weekly PPL as of each later week's end, the WikiText probe every 7 days, the QA quiz."""
    out: dict = {"weeks": {}, "text": {}, "qa": {}}
    ends: dict[str, dt.date] = {}
    for d in dates:
        ends[period_of(d, "week")] = d
    tests: dict[str, list] = {}
    for d in dates:
        tests.setdefault(period_of(d, "week"), []).extend(read_day(args.source, d).test)
    for week, docs in tests.items():
        cells = {(n, str(end)): m.at(end) for n, m in memories.items() for w, end in ends.items() if w >= week}
        r = evaluate_many(features.lm, docs, {("bare", ""): None} | cells, features, f"week-{week}")
        out["weeks"][week] = {"ppl_lm": r[("bare", "")]["ppl_lm"], "tokens": r[("bare", "")]["tokens"],
                              "ppl": {f"{n}@{d}": v["ppl"] for (n, d), v in r.items() if n != "bare"}}
    if args.text:
        probes = sorted({*dates[6::7], dates[-1]})
        doc = text_document(args.text, args.text_chars)
        cells = {(n, str(d)): m.at(d) for n, m in memories.items() for d in probes}
        r = evaluate_many(features.lm, [doc], {("bare", ""): None} | cells, features, "text")
        out["text"] = {"ppl_lm": r[("bare", "")]["ppl_lm"], "tokens": r[("bare", "")]["tokens"],
                       "ppl": {f"{n}@{d}": v["ppl"] for (n, d), v in r.items() if n != "bare"}}
    if args.qa:
        questions = read_questions(args.qa, dates[0], dates[-1] + dt.timedelta(days=7))
        answers = answer_questions(features.lm, questions, {"bare": None, **memories}, 0, read_questions(args.qa))
        out["qa"] = {n: {k: v for k, v in a.items()} for n, a in answers.items()}
    return out


def weighted_ppl(rows: list[dict], name: str | None) -> float:
    """PPL over every test token of the days (None: the LM alone)."""
    nll = sum(r["test_tokens"] * math.log(r["ppl_lm"] if name is None else r["runs"][name]["ppl"]) for r in rows)
    return math.exp(nll / sum(r["test_tokens"] for r in rows))


def growth_exponent(rows: list[dict], name: str) -> float:
    """b in entries ∝ (tokens seen)^b, least squares over the days (b < 1: sub-linear growth)."""
    seen = np.cumsum([r["runs"][name]["tokens"] for r in rows])
    entries = np.array([r["runs"][name]["entries"] for r in rows])
    return float(np.polyfit(np.log(seen), np.log(entries), 1)[0])


def _header(columns: list[str]) -> str:
    return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def render(rows: list[dict], suite: dict | None) -> str:
    """The report's tables, as markdown."""
    names = {"fullmem": "FullMem", "randmem": "RandMem", "monim-amt": "MoNIM-AMT"}
    out = [_header(["day", "articles", "train tokens", "test tokens", "LM", *names.values(), "MoNIM MemRate (day / all)",
                    "entries MoNIM / FullMem", "s: LM, memorize, calibrate, evaluate"])]
    for r in rows:
        m, s = r["runs"]["monim-amt"], r["seconds"]
        stage = [s["featurize"], *(sum(v for k, v in s.items() if k.startswith(p)) for p in ("memorize", "calibrate")),
                 s["evaluate"]]
        out.append(f"| {r['date'][5:]} | {r['articles']} | {m['tokens']:,} | {r['test_tokens']:,} | {r['ppl_lm']:.2f} | "
                   + " | ".join(f"{r['runs'][n]['ppl']:.2f}" + (" fb" if r["runs"][n]["fallback"] else "") for n in names)
                   + f" | {m['memrate_day']:.1%} / {m['memrate']:.1%} | {m['entries']:,} / {r['runs']['fullmem']['entries']:,}"
                   + f" | {', '.join(f'{x:.0f}' for x in stage)} |")
    out.append(f"| all | {sum(r['articles'] for r in rows)} | {sum(r['runs']['fullmem']['tokens'] for r in rows):,} | "
               f"{sum(r['test_tokens'] for r in rows):,} | **{weighted_ppl(rows, None):.2f}** | "
               + " | ".join(f"**{weighted_ppl(rows, n):.2f}**" for n in names)
               + f" | growth exponent {growth_exponent(rows, 'monim-amt'):.3f} | | "
               + f"{sum(sum(r['seconds'].values()) for r in rows) / 3600:.1f} h in all |")
    if suite and suite.get("weeks"):
        cells = sorted({c.split("@")[1] for w in suite["weeks"].values() for c in w["ppl"]})
        out += ["", _header(["test week", "tokens", "LM", *(f"{names[n]} @ {d[5:]}" for n in names for d in cells)])]
        for week, w in suite["weeks"].items():
            out.append(f"| {week} | {w['tokens']:,} | {w['ppl_lm']:.2f} | "
                       + " | ".join(f"{w['ppl'][f'{n}@{d}']:.2f}" if f"{n}@{d}" in w["ppl"] else "" for n in names for d in cells) + " |")
    if suite and suite.get("text"):
        t = suite["text"]
        out += ["", f"WikiText probe ({t['tokens']:,} tokens): LM {t['ppl_lm']:.2f}; "
                + "; ".join(f"{names[n]} " + ", ".join(f"{v:.2f} @ {c.split('@')[1][5:]}" for c, v in t["ppl"].items()
                                                     if c.split("@")[0] == n) for n in names)]
    if suite and suite.get("qa"):
        qa = suite["qa"]
        out += ["", "QA quiz (0-shot, final memories): " + "; ".join(
            f"{'LM' if n == 'bare' else names[n]} {a['qa_accuracy']:.1%} (n = {a['qa_n']}, 95% CI {a['qa_ci_low']:.1%}–"
            f"{a['qa_ci_high']:.1%})" for n, a in qa.items())]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--source", type=Path, default=DATA / "news" / "realtimeqa-2022-06-to-09.jsonl.gz")
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--end", type=dt.date.fromisoformat, default=dt.date(2022, 6, 30))
    ap.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "results" / "full-volume-work")
    ap.add_argument("--text", type=Path, default=DATA / "wikitext" / "wiki.test.raw")
    ap.add_argument("--text-chars", type=int, default=20000)
    ap.add_argument("--qa", type=Path, default=DATA / "qa" / "realtimeqa-quiz-2022-06-to-09.jsonl")
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-size", type=int, default=None, help="rows per forward pass (default: 8 on a CPU, 64 on a GPU)")
    ap.add_argument("--stop-after", type=float, default=None, help="Stop (resumably) after this many seconds.")
    ap.add_argument("--report", action="store_true", help="Only write the report of the days already learned.")
    args = ap.parse_args()
    started, console = time.perf_counter(), Console(width=160)
    rows_path, report_path = args.workdir / "rows.json", REPO / "benchmarks" / "results" / "full-volume.md"
    if args.report:
        rows = [r for d, r in sorted(json.loads(rows_path.read_text()).items()) if args.start.isoformat() <= d <= args.end.isoformat()]
        suite_path = args.workdir / f"suite-{rows[0]['date']}-{rows[-1]['date']}.json"
        report_path.write_text(render(rows, json.loads(suite_path.read_text()) if suite_path.exists() else None))
        console.print(report_path.read_text())
        return
    lm = load_lm(args.model)
    features = Features(lm, ScoreConfig(batch_size=args.batch_size), args.workdir / "features")
    memories = {name: Memory(args.workdir / name, lm, Settings(calibrator=CalibratorConfig())) for name in POLICIES}
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else {}
    dates = list_dates(args.source, args.start, args.end)
    for date in dates:
        if date.isoformat() in rows:
            continue
        if args.stop_after and time.perf_counter() - started > args.stop_after:
            console.print("stopping (resumable)")
            return
        row = learn_day(date, args, features, memories)
        rows[row["date"]] = row
        rows_path.write_text(json.dumps(rows, indent=1))
        console.print(f"{row['date']}: {row['articles']} articles, {row['runs']['fullmem']['tokens']} tokens; PPL LM "
                      f"{row['ppl_lm']:.2f}, " + ", ".join(f"{n} {r['ppl']:.2f} ({r['entries']} entries)"
                                                         for n, r in row["runs"].items())
                      + f"; {sum(row['seconds'].values()):.0f} s")
    suite_path = args.workdir / f"suite-{dates[0]}-{dates[-1]}.json"
    if not suite_path.exists():
        suite_path.write_text(json.dumps(suite(args, features, memories, dates), indent=1))
    report_path.write_text(render([rows[d.isoformat()] for d in dates], json.loads(suite_path.read_text())))
    console.print(report_path.read_text())
    console.print(f"done: {rows_path}, {suite_path}, {report_path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
