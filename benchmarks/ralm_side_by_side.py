"""In-Context RALM alone and with MoNIM-AMT beside the LM, FullMem and MoNIM-AMT: PPL and the quiz.

What a user would pick instead, side by side: In-Context RALM (BM25 articles in the prompt) alone and
with MoNIM-AMT, beside the LM, FullMem and MoNIM-AMT, each day learned through the library's run
(monim.run.MemoryRun) at full volume, then the quiz with the final memories.

Per day and run: test PPL (all tokens, novel articles), bytes on disk, learning seconds, scoring
seconds per 1,000 test tokens and the LM tokens read per scored token. Scoring a kNN memory costs the
LM's pass over the test text (timed live once a day: what the LM alone pays) plus its search and Θ;
RALM's cost is its own passes (a window per stride); ralm and ralm+monim-amt share those passes, so
ralm+monim-amt is charged the pair's evaluation and ralm its passes alone.
Resumable: rows go to --out after each day (a committed day is not learned again); the features come
from the work directory's store (--features shares another's).
Usage: monim bench ralm-side-by-side --start 2022-06-01 --end 2022-06-14 --out docs/results/ralm-side-by-side/realtimeqa.json
"""

import datetime as dt
import math
import time
from pathlib import Path

from benchmarks.harness import QUIZ, RTQA, WORK, parser, resume, save

from monim.core.config import EvalConfig

from monim.core.run_config import RunConfig
from monim.evaluation.evaluate import evaluate_many
from monim.lm.features import Features
from monim.evaluation.qa import answer_questions, read_questions, wilson
from monim.run import MemoryRun, make_run
from monim.data.stream import list_dates

POLICIES = "fullmem,monim-amt,ralm,ralm+monim-amt"
PAIRED = ("ralm", "ralm+monim-amt")  # evaluated together: one RALM pass


def open_runs(args) -> dict[str, MemoryRun]:
    runs = {p: make_run(RunConfig(source=str(args.source), workdir=str(args.workdir), policy=p, model=args.model))
            for p in args.policies.split(",")}
    first = next(iter(runs.values()))
    features = Features(first.lm, first.cfg.window(), args.features) if args.features else first.features
    for run in runs.values():
        run.features = features
    return runs


def lm_test_seconds(run: MemoryRun, docs: list) -> float:
    """The LM alone's pass over the day's test articles, timed live (the store would hand it over)."""
    started = time.perf_counter()
    for _ in Features(run.lm, run.cfg.window()).scores(docs):
        pass
    return time.perf_counter() - started


def learn_day(date: dt.date, runs: dict[str, MemoryRun]) -> dict:
    first = next(iter(runs.values()))
    day = first.ingest(date)  # the product's reading: capped articles, as every run reads them
    started = time.perf_counter()
    lm_tokens = first.featurize(day, ("train", "validation", "test"))["tokens"]
    row = {"date": date.isoformat(), "articles": len(day.train), "test_articles": len(day.test),
           "featurize_s": time.perf_counter() - started, "featurized_tokens": lm_tokens,
           "lm_test_s": lm_test_seconds(first, day.test), "runs": {}}
    for name, run in runs.items():
        started = time.perf_counter()
        learned = run.learn(day, 0)
        row["runs"][name] = {"learn_s": time.perf_counter() - started, "entries": len(run.memory),
                             "bytes": run.memory.bytes_on_disk(), "memrate": run.memory.ds.memrate,
                             "lam": learned.get("lam")}
    lm = first.lm
    groups = [[n] for n in runs if n not in PAIRED] + [[n for n in runs if n in PAIRED]]
    for group in (g for g in groups if g):
        started = time.perf_counter()
        result = evaluate_many(lm, day.test, {n: runs[n].memory.at(date.isoformat()) for n in group}, first.features,
                               f"{date}-test")
        seconds = time.perf_counter() - started
        for n in group:
            r = result[n]
            own = r.get("ralm_seconds", seconds) if n == "ralm" else seconds + (0 if n in PAIRED else row["lm_test_s"])
            row["runs"][n] |= {k: r[k] for k in ("tokens", "ppl", "ppl_lm", "ppl_novel", "ppl_lm_novel", "twin_share",
                                                  "accuracy")} | {
                "score_s": own, "score_s_per_1k": 1000 * own / max(r["tokens"], 1),
                "lm_tokens_per_token": r.get("lm_tokens_per_token", 1.0)}
    return row


def quiz(args, runs: dict[str, MemoryRun], first: dt.date, last: dt.date) -> dict:
    """The quiz's questions of the stream's days (the suite's window: to a week after the last, a quiz
    asking about the week before its date), with the final memories (0-shot)."""
    first, last = EvalConfig().qa_window(first, last)
    questions = [q for q in read_questions(args.qa) if first <= q.date <= last]
    if not questions:
        return {}
    started = time.perf_counter()
    lm = next(iter(runs.values())).lm
    answers = answer_questions(lm, questions, {"bare": None} | {n: r.memory for n, r in runs.items()}, 0)
    return {n: a | {"hits": round(a["qa_accuracy"] * a["qa_n"])} for n, a in answers.items()} | {
        "seconds": time.perf_counter() - started}


def ppl_over(rows: list[dict], name: str, key: str = "ppl", share: bool = False) -> float:
    """PPL over every test token of the days (`share`: the novel articles' tokens only)."""
    pairs = [(r["runs"][name]["tokens"] * ((1 - r["runs"][name]["twin_share"]) if share else 1), r["runs"][name][key])
             for r in rows]
    pairs = [(n, p) for n, p in pairs if n > 0 and not math.isnan(p)]
    return math.exp(sum(n * math.log(p) for n, p in pairs) / sum(n for n, _ in pairs)) if pairs else math.nan


def summary(rows: list[dict], qa: dict) -> list[dict]:
    """One line a run over the stream: what the report's side-by-side table shows."""
    first = next(iter(rows[0]["runs"]))
    out = [{"run": "LM", "ppl": ppl_over(rows, first, "ppl_lm"), "ppl_novel": ppl_over(rows, first, "ppl_lm_novel", True),
            "bytes": 0, "learn_s_per_day": 0.0,
            "score_s_per_1k": 1000 * sum(r["lm_test_s"] for r in rows) / sum(next(iter(r["runs"].values()))["tokens"] for r in rows),
            "lm_tokens_per_token": 1.0} | _qa(qa.get("bare"))]
    for n in rows[0]["runs"]:
        tokens = sum(r["runs"][n]["tokens"] for r in rows)
        out.append({"run": n, "ppl": ppl_over(rows, n), "ppl_novel": ppl_over(rows, n, "ppl_novel", True),
                    "bytes": rows[-1]["runs"][n]["bytes"], "memrate": rows[-1]["runs"][n]["memrate"],
                    "learn_s_per_day": sum(r["runs"][n]["learn_s"] for r in rows) / len(rows),
                    "score_s_per_1k": 1000 * sum(r["runs"][n]["score_s"] for r in rows) / tokens,
                    "lm_tokens_per_token": sum(r["runs"][n]["lm_tokens_per_token"] * r["runs"][n]["tokens"] for r in rows) / tokens}
                   | _qa(qa.get(n)))
    return out


def _qa(a: dict | None) -> dict:
    if not a:
        return {}
    low, high = wilson(a["hits"], a["qa_n"])
    return {"qa": a["qa_accuracy"], "qa_n": a["qa_n"], "qa_low": low, "qa_high": high}


def render(lines: list[dict]) -> str:
    head = "| run | test PPL | PPL, novel articles | QA (95% CI) | MB on disk | learning s/day | scoring s per 1k test tokens | LM tokens read per scored token |"
    out = [head, "|---" * 8 + "|"]
    for s in lines:
        qa = f"{s['qa']:.1%} ({s['qa_low']:.1%}–{s['qa_high']:.1%}), n = {s['qa_n']}" if "qa" in s else ""
        out.append(f"| {s['run']} | {s['ppl']:.2f} | {s['ppl_novel']:.2f} | {qa} | {s['bytes'] / 1e6:.1f} | "
                   f"{s['learn_s_per_day']:.1f} | {s['score_s_per_1k']:.2f} | {s['lm_tokens_per_token']:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "ralm-side-by-side")
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--end", type=dt.date.fromisoformat, default=dt.date(2022, 6, 14))
    ap.add_argument("--qa", type=Path, default=QUIZ)
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--model", default=None)
    ap.add_argument("--workdir", type=Path, default=WORK / "ralm")
    ap.add_argument("--features", type=Path, default=None, help="a feature store to share (another work directory's)")
    args = ap.parse_args(argv)
    out = resume(args.out, {"rows": []})
    out |= {"source": args.source.name, "start": str(args.start), "end": str(args.end), "policies": args.policies}
    runs = open_runs(args)
    done = {r["date"] for r in out["rows"]}
    for date in list_dates(args.source, args.start, args.end):
        if date.isoformat() in done:
            continue
        row = learn_day(date, runs)
        out["rows"].append(row)
        save(args.out, out, args)
        print(date, {n: (round(r["ppl"], 2), round(r["score_s_per_1k"], 2)) for n, r in row["runs"].items()}, flush=True)
    if not out.get("qa") and args.qa and args.qa.exists():
        out["qa"] = quiz(args, runs, args.start, args.end)
        save(args.out, out, args)
    out["summary"] = summary(out["rows"], out.get("qa") or {})
    save(args.out, out, args)
    print(render(out["summary"]))


if __name__ == "__main__":
    main()
