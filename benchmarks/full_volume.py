"""Full daily volume: FullMem, RandMem and MoNIM-AMT on every article of a stream, PPL, QA and growth.

Full daily volume: a stream learned with EVERY training article by FullMem, RandMem (at MoNIM's
MemRate) and MoNIM-AMT, beside the bare LM; the LM runs once per article (feature store). Each day is
learned through the library's run (monim.run.MemoryRun: memorize, then calibrate), one a memory.

Per day: test PPL of each memory, entries, MemRate, wall time per stage. At the end: each week's
(--period) test PPL with each memory as of every later week's end (the forgetting matrix), the
WikiText probe at each week's end, and the QA quiz by month with each memory as of every month's
end (the paper's Tables 6 and 7). Resumable: the work directory keeps the memories, the features
and rows.json; a finished day is not redone, nor a finished part of the suite (a memory's PPL on a
period or the probe, a month of the quiz; kept per date range), so a run repeated with a later
--qa-end measures only the months it adds.
Per day besides: the share of the training tokens whose article has a twin in the memory of the
days before (`twin_share_train`) or earlier in the same day (`same_day_twin_share`), the rate a
θ-reading policy would store at with the LM alone (`memrate_lm`: what the memory moved below the
threshold is memrate_lm - memrate_day), and λ's quantiles on the test tokens.
`--policies`: runs besides the bare LM; `name@param=value` changes a policy's parameter (e.g.
`monim-amt@delta=-1.0`), a `-const` suffix reads the memory with the constant λ, `-val` with a calibrator
trained on validation articles only (the paper's calibration). RandMem stores at MoNIM-AMT's
MemRate over the stream so far, by the catalogue's one rule (monim.core.catalogue.followed_memrate; until
issue 46 it stored at MoNIM-AMT's rate of the day, and so did KL, which now stores at its own rate:
0.5 unless `kl@rate=...`). `--features` lets several work directories share one feature store.
Writes the report's tables to WORKDIR/report.md (--report: only that, from what is learned).
SIGINT or SIGTERM stops after the day or suite part being measured (resumably); a second one stops at once.
Usage: monim bench full-volume --start 2022-06-01 --end 2022-06-30 [--workdir DIR] [--report]
"""

import datetime as dt
import json
import math
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from benchmarks.harness import DATA, QUIZ, RTQA, WORK, parser, save
import numpy as np
import scipy.stats
from rich.console import Console

from monim.core.catalogue import followed_memrate
from monim.core.config import period_of
from monim.core.run_config import RunConfig
from monim.data.dedup import twin_groups
from monim.evaluation.evaluate import evaluate_many, theta_of
from monim.evaluation.suite import text_document
from monim.lm.features import Features
from monim.theta.memory import Memory
from monim.evaluation.qa import answer_questions, read_questions, wilson
from monim.learning.policies import MoNIM, run_policy
from monim.run import MemoryRun, make_run
from monim.data.stream import list_dates, read_day

POLICIES = "monim-amt,fullmem,randmem"  # MoNIM first: RandMem stores at its MemRate


READINGS = {"-const": ("const λ", {"calibrated": False}),  # how Θ reads a memory, by a run name's suffix (RunConfig fields)
            "-val": ("validation-only calibrator", {"calibrator": {"source": "validation"}})}


def parse_run(spec: str) -> tuple[str, dict, str]:
    """'monim-amt@delta=-1.0' -> ('monim-amt', {'delta': -1.0}, ''); 'fullmem-const' -> ('fullmem', {}, '-const')."""
    name, *params = spec.split("@")
    suffix = next((x for x in READINGS if name.endswith(x)), "")
    return name.removesuffix(suffix) if suffix else name, {k: float(v) for k, v in (p.split("=") for p in params)}, suffix


def open_runs(args) -> dict[str, MemoryRun]:
    """A run a --policies entry, learning into WORKDIR/<its name>: its policy's parameters, how Θ reads
    it, the LM and the batch size as RunConfig fields; one feature store for all (--features)."""
    runs = {}
    for spec in args.policies.split(","):
        base, params, suffix = parse_run(spec)
        cfg = RunConfig(source=str(args.source), workdir=str(args.workdir), policy=base, model=args.model,
                        batch_size=args.batch_size, **params, **READINGS.get(suffix, ("", {}))[1])
        runs[spec] = make_run(cfg, root=args.workdir / spec.replace("@", "-").replace("=", ""))
    first = next(iter(runs.values()))
    features = Features(first.lm, first.cfg.window(), args.features) if args.features else first.features
    for run in runs.values():
        run.features = features
    return runs


def following(cfg: RunConfig, memrates: dict[str, float]) -> RunConfig:
    """The run's settings for the day: the MemRate it follows, by the catalogue's one rule (RandMem:
    MoNIM-AMT's over the stream so far, `memrates` holding the runs learned before it that day)."""
    return RunConfig.model_validate(cfg.model_dump() | {"followed_memrate": followed_memrate(cfg.policy, memrates)})


@contextmanager
def timed(seconds: dict, stage: str) -> Iterator[None]:
    """Add the block's wall time to seconds[stage]."""
    started = time.perf_counter()
    yield
    seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - started


def lam_quantiles(memory: Memory, docs: list, features: Features, name: str) -> dict:
    """λ's mean and 10/50/90th percentiles over the documents' tokens, as Θ reads this memory."""
    lams = [np.broadcast_to(np.asarray(memory.lam(b), float), (len(b),))
            for b in features.scores(docs, name, memory.search) if len(b)]
    lam = np.concatenate(lams) if lams else np.zeros(0)
    if not len(lam):
        return {}
    return {"lam_mean": float(lam.mean())} | {f"lam_p{q}": float(np.quantile(lam, q / 100)) for q in (10, 50, 90)}


def memrate_lm(policy, docs: list, features: Features, name: str) -> float:
    """The share of the documents' tokens the policy would store reading the LM alone (an empty memory)."""
    rng, stored, seen = np.random.default_rng(0), 0, 0
    for b in features.scores(docs, name):
        stored += int(policy.select(b, theta_of(b, None), features.lm, rng).sum())
        seen += len(b)
    return stored / max(seen, 1)


def twin_shares(memory: Memory, docs: list, features: Features) -> tuple[float, float]:
    """Token shares of the documents with a twin in the memory's earlier days, and earlier in the same day."""
    sizes = np.array([len(t) for t in features.tokenize(docs)], float)
    earlier = memory.has_twin(docs) if len(memory.days) else np.zeros(len(docs), bool)
    groups = twin_groups([d.text for d in docs])
    same_day = np.array([g != i for i, g in enumerate(groups)], bool)
    total = max(sizes.sum(), 1.0)
    return float(sizes[earlier].sum() / total), float(sizes[same_day].sum() / total)


def learn_day(date: dt.date, args, runs: dict[str, MemoryRun]) -> dict:
    """The day learned by each run (memorize and calibrate, timed apart), measured and evaluated."""
    seconds: dict[str, float] = {}
    with timed(seconds, "read"):
        day = read_day(args.source, date)
    first = next(iter(runs.values()))
    features = first.features  # every run's
    with timed(seconds, "featurize"):
        lm_tokens = first.featurize(day)["tokens"]
    row = {"date": date.isoformat(), "articles": len(day.train), "lm_tokens": lm_tokens, "runs": {}}
    with timed(seconds, "twins"):
        row["twin_share_train"], row["same_day_twin_share"] = twin_shares(first.memory, day.train, features)
    memrates: dict[str, float] = {}
    for name, run in runs.items():
        run.cfg = following(run.cfg, memrates)
        with timed(seconds, f"memorize_{name}"):
            stats = run.memorize(day)
        with timed(seconds, f"calibrate_{name}"):
            theta = run.calibrate(day)
        learned, memory, policy = MemoryRun.learned(stats, theta), run.memory, run_policy(run.cfg)
        memrates[name] = learned["memrate"]
        row["runs"][name] = {"tokens": learned["tokens_seen"], "stored": learned["entries_stored"],
                             "memrate_day": learned["memrate_day"], "entries": learned["entries"],
                             "memrate": learned["memrate"], "lam": learned["lam"], "fallback": memory.fallback,
                             "nll": theta["summary"].get("nll"), "search_s": stats["seconds"].get("search")}
        with timed(seconds, f"measure_{name}"):
            if isinstance(policy, MoNIM):  # a rule that reads Θ: what the LM alone would store
                row["runs"][name]["memrate_lm"] = memrate_lm(policy, day.train, features, f"{date}-train")
            row["runs"][name] |= lam_quantiles(memory, day.test, features, f"{date}-test")
    with timed(seconds, "evaluate"):
        memories = {name: run.memory for name, run in runs.items()}
        result = evaluate_many(features.lm, day.test, {"bare": None, **memories}, features, f"{date}-test")
    row["test_tokens"] = result["bare"]["tokens"]
    row["ppl_lm"] = result["bare"]["ppl_lm"]
    for name in memories:
        row["runs"][name] |= {k: result[name][k] for k in ("ppl", "ppl_novel", "ppl_lm_novel", "twin_share", "accuracy")}
    row["seconds"] = seconds
    return row


def suite(args, features: Features, memories: dict[str, Memory], dates: list[dt.date], part: Path,
          stop: Callable[[], bool]) -> dict | None:
    """Each period's test PPL with each memory as of every later period's end, the WikiText probe at
    each period's end, and the QA quiz by month with each memory as of every month's end (Table 7).
    Each part (a memory's PPL on a period or the probe, a month of the quiz) is kept in `part` as it
    ends, so a stopped suite goes on from the next part; None when `stop()` asks to stop before one."""
    out: dict = json.loads(part.read_text()) if part.exists() else {"periods": {}, "text": {}, "qa": {}}
    ends = {period_of(d, args.period): d for d in dates}
    tests: dict[str, list] = {}
    for d in dates:
        tests.setdefault(period_of(d, args.period), []).extend(read_day(args.source, d).test)
    ppl_parts = [(out["periods"], period, docs, f"{n}@{end}", m.at(end), f"{args.period}-{period}")
                 for period, docs in tests.items() for n, m in memories.items() for p, end in ends.items() if p >= period]
    if args.text:
        doc = text_document(args.text, args.text_chars)
        ppl_parts += [(out, "text", [doc], f"{n}@{d}", m.at(d), "text") for n, m in memories.items() for d in ends.values()]
    for section, key, docs, cell, memory, name in ppl_parts:  # the LM's features come from the store
        row = section.get(key) or {"ppl": {}}
        if cell in row["ppl"]:
            continue
        if stop():
            return None
        r = evaluate_many(features.lm, docs, {cell: memory}, features, name)[cell]
        section[key] = row | {"ppl_lm": r["ppl_lm"], "tokens": r["tokens"], "ppl": row["ppl"] | {cell: r["ppl"]}}
        save(part, out)
    pool = read_questions(args.qa) if args.qa else []
    questions = [q for q in pool if dates[0] <= q.date <= (args.qa_end or dates[-1] + dt.timedelta(days=7))]
    month_ends = {period_of(d, "month"): d for d in dates}.values()
    cells = {"bare": None} | {f"{n}@{d}": m.at(d) for n, m in memories.items() for d in month_ends}
    for month in sorted({period_of(q.date, "month") for q in questions}):  # the LM runs on the quiz: a month at once
        if month in out["qa"]:
            continue
        if stop():
            return None
        asked = [q for q in questions if period_of(q.date, "month") == month]
        answers = answer_questions(features.lm, asked, cells, 0, pool)
        out["qa"][month] = {c: {"hits": round(a["qa_accuracy"] * a["qa_n"]), "n": a["qa_n"]} for c, a in answers.items()}
        save(part, out)
    return out


def suite_files(workdir: Path, first: str | dt.date, last: str | dt.date) -> tuple[Path, Path]:
    """The suite of the days from `first` to `last`, and the part file it is kept in until whole."""
    path = workdir / f"suite-{first}-{last}.json"
    return path, path.with_suffix(".part.json")


def novel_ppl(rows: list[dict], name: str) -> float:
    """PPL over the test tokens of articles without a twin in the memory."""
    pairs = [(r["test_tokens"] * (1 - r["runs"][name]["twin_share"]), r["runs"][name]["ppl_novel"]) for r in rows]
    pairs = [(n, p) for n, p in pairs if n > 0 and not math.isnan(p)]
    return math.exp(sum(n * math.log(p) for n, p in pairs) / sum(n for n, _ in pairs)) if pairs else math.nan


def weighted_ppl(rows: list[dict], name: str | None) -> float:
    """PPL over every test token of the days (None: the LM alone)."""
    nll = sum(r["test_tokens"] * math.log(r["ppl_lm"] if name is None else r["runs"][name]["ppl"]) for r in rows)
    return math.exp(nll / sum(r["test_tokens"] for r in rows))


def growth_exponent(rows: list[dict], name: str) -> tuple[float, float, float]:
    """b in entries ∝ (tokens seen)^b, least squares over the days (b < 1: sub-linear growth), with
    its 95% confidence interval (the slope's t interval; needs 3 days or more)."""
    x = np.log(np.cumsum([r["runs"][name]["tokens"] for r in rows]))
    y = np.log([r["runs"][name]["entries"] for r in rows])
    fit = scipy.stats.linregress(x, y)
    half = scipy.stats.t.ppf(0.975, len(x) - 2) * fit.stderr if len(x) > 2 else math.nan
    return float(fit.slope), float(fit.slope - half), float(fit.slope + half)


def _header(columns: list[str]) -> str:
    return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def label(name: str) -> str:
    base, params, suffix = parse_run(name)
    shown = {"fullmem": "FullMem", "randmem": "RandMem", "monim-amt": "MoNIM-AMT", "monim": "MoNIM", "kl": "KL"}
    return shown.get(base, base) + "".join(f" {k}={v:g}" for k, v in params.items()) + (f" ({READINGS[suffix][0]})" if suffix else "")


def qa_tables(qa: dict, names: list[str]) -> list[str]:
    """The quiz with the final memories (Table 6), then accuracy by month and by two months as the
    memories learn (Table 7: a row per memory as of a period's end, a column per period's questions)."""
    months = list(qa)
    ends = {e[:7]: e for e in sorted({c.rsplit("@", 1)[1] for c in qa[months[0]] if "@" in c})}

    def tally(cell: str, asked: list[str]) -> tuple[int, int]:
        return sum(qa[m][cell]["hits"] for m in asked), sum(qa[m][cell]["n"] for m in asked)

    def accuracy(cell: str, asked: list[str]) -> str:
        hits, n = tally(cell, asked)
        return f"{hits / n:.1%}" if n else ""

    last = list(ends.values())[-1]
    final = []
    for cell in ["bare", *(f"{n}@{last}" for n in names)]:
        hits, n = tally(cell, months)
        low, high = wilson(hits, n)
        final.append(f"{'LM' if cell == 'bare' else label(cell.rsplit('@', 1)[0])} {hits / n:.1%} (95% CI {low:.1%}–{high:.1%})")
    out = [f"QA quiz (0-shot, all {sum(qa[m]['bare']['n'] for m in months)} questions, the final memories): "
           + "; ".join(final)]
    for blocks in ([[m] for m in months], [months[i:i + 2] for i in range(0, len(months), 2)]):
        columns = [f"{b[0]}" + (f"..{b[-1][5:]}" if len(b) > 1 else "") + f" (n = {sum(qa[m]['bare']['n'] for m in b)})"
                   for b in blocks]
        out += ["", _header(["memory", "learned through", *columns]),
                "| LM | | " + " | ".join(accuracy("bare", b) for b in blocks) + " |"]
        for n in names:
            for b in blocks:
                if b[-1] in ends:
                    out.append(f"| {label(n)} | {ends[b[-1]]} | " + " | ".join(accuracy(f"{n}@{ends[b[-1]]}", c) for c in blocks) + " |")
    return out


def render(rows: list[dict], suite: dict | None) -> str:
    """The report's tables, as markdown."""
    names = list(rows[0]["runs"])
    out = [_header(["day", "articles", "train tokens", "twins: earlier / same day", "test tokens", "LM", *map(label, names),
                    "MoNIM MemRate: day / all / LM alone", "entries MoNIM / FullMem", "s: LM, memorize, calibrate, evaluate"])]
    for r in rows:
        m, s = r["runs"]["monim-amt"], r["seconds"]
        stage = [s["featurize"], *(sum(v for k, v in s.items() if k.startswith(p)) for p in ("memorize", "calibrate")),
                 s["evaluate"]]
        lm_rate = f" / {m['memrate_lm']:.1%}" if "memrate_lm" in m else ""
        out.append(f"| {r['date'][5:]} | {r['articles']} | {m['tokens']:,} | "
                   + (f"{r['twin_share_train']:.1%} / {r['same_day_twin_share']:.1%}" if "twin_share_train" in r else "")
                   + f" | {r['test_tokens']:,} | {r['ppl_lm']:.2f} | "
                   + " | ".join(f"{r['runs'][n]['ppl']:.2f}" + (" fb" if r["runs"][n]["fallback"] else "") for n in names)
                   + f" | {m['memrate_day']:.1%} / {m['memrate']:.1%}{lm_rate} | "
                   + f"{m['entries']:,} / {r['runs'].get('fullmem', m)['entries']:,}"
                   + f" | {', '.join(f'{x:.0f}' for x in stage)} |")
    out.append(f"| all | {sum(r['articles'] for r in rows)} | {sum(r['runs']['monim-amt']['tokens'] for r in rows):,} | | "
               f"{sum(r['test_tokens'] for r in rows):,} | **{weighted_ppl(rows, None):.2f}** | "
               + " | ".join(f"**{weighted_ppl(rows, n):.2f}**" for n in names)
               + f" | | | {sum(sum(r['seconds'].values()) for r in rows) / 3600:.1f} h in all |")
    out += ["", _header(["memory", "test PPL", "PPL, novel articles", "MemRate", "entries", "growth exponent (95% CI)",
                         "λ on test tokens: mean (p10–p90), last day"])]
    for n in names:
        b, lo, hi = growth_exponent(rows, n)
        last = rows[-1]["runs"][n]
        lam = f"{last['lam_mean']:.2f} ({last['lam_p10']:.2f}–{last['lam_p90']:.2f})" if "lam_mean" in last else ""
        out.append(f"| {label(n)} | {weighted_ppl(rows, n):.2f} | {novel_ppl(rows, n):.2f} | {last['memrate']:.1%} | "
                   f"{last['entries']:,} | {b:.3f} ({lo:.3f}–{hi:.3f}) | {lam} |")
    if suite and suite.get("periods"):
        cells = sorted({c.rsplit("@", 1)[1] for p in suite["periods"].values() for c in p["ppl"]})
        out += ["", _header(["test period", "tokens", "LM", *(f"{label(n)} @ {d[5:]}" for n in names for d in cells)])]
        for period, p in suite["periods"].items():
            out.append(f"| {period} | {p['tokens']:,} | {p['ppl_lm']:.2f} | "
                       + " | ".join(f"{p['ppl'][f'{n}@{d}']:.2f}" if f"{n}@{d}" in p["ppl"] else "" for n in names for d in cells) + " |")
    if suite and suite.get("text"):
        t = suite["text"]
        out += ["", f"WikiText probe ({t['tokens']:,} tokens): LM {t['ppl_lm']:.2f}; "
                + "; ".join(f"{label(n)} " + ", ".join(f"{v:.2f} @ {c.rsplit('@', 1)[1][5:]}" for c, v in t["ppl"].items()
                                                     if c.rsplit("@", 1)[0] == n) for n in names)]
    if suite and suite.get("qa"):
        out += ["", *qa_tables(suite["qa"], names)]
    return "\n".join(out) + "\n"


def stop_asked(console: Console) -> list[int]:
    """The signals received so far: the first SIGINT/SIGTERM lets the day being learned (or the suite's
    part being measured) finish (its memories and rows.json agree then), a second one stops at once."""
    asked: list[int] = []

    def handler(signum, frame) -> None:
        if asked:
            signal.default_int_handler(signum, frame)
        asked.append(signum)
        console.print("stopping after this day or part of the suite (resumable); signal again to stop now")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)
    return asked


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "full-volume")
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--end", type=dt.date.fromisoformat, default=dt.date(2022, 6, 30))
    ap.add_argument("--workdir", type=Path, default=WORK / "full-volume")
    ap.add_argument("--text", type=Path, default=DATA / "wikitext" / "wiki.test.raw")
    ap.add_argument("--text-chars", type=int, default=20000)
    ap.add_argument("--qa", type=Path, default=QUIZ)
    ap.add_argument("--qa-end", type=dt.date.fromisoformat, default=None,
                    help="the quiz's last question date (default: a week after --end); later months test what the memory cannot know yet")
    ap.add_argument("--period", choices=("week", "month"), default="week", help="the forgetting matrix's periods")
    ap.add_argument("--model", default=None)
    ap.add_argument("--policies", default=POLICIES, help="comma-separated runs (name[-const|-val][@param=value])")
    ap.add_argument("--features", type=Path, default=None, help="the feature store (default: WORKDIR/features)")
    ap.add_argument("--batch-size", type=int, default=None, help="rows per forward pass (default: 8 on a CPU, 64 on a GPU)")
    ap.add_argument("--stop-after", type=float, default=None, help="Stop (resumably) after this many seconds.")
    ap.add_argument("--report", action="store_true", help="Only write the report of the days already learned.")
    args = ap.parse_args(argv)
    started, console = time.perf_counter(), Console(width=160)
    rows_path, report_path = args.workdir / "rows.json", args.workdir / "report.md"
    if args.report:
        rows = [r for d, r in sorted(json.loads(rows_path.read_text()).items()) if args.start.isoformat() <= d <= args.end.isoformat()]
        kept = [p for p in suite_files(args.workdir, rows[0]["date"], rows[-1]["date"]) if p.exists()]  # or a stopped one's parts
        report_path.write_text(render(rows, json.loads(kept[0].read_text()) if kept else None))
        console.print(report_path.read_text())
        return
    runs = open_runs(args)
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else {}
    dates = list_dates(args.source, args.start, args.end)
    asked = stop_asked(console)

    def stop() -> bool:
        if asked or args.stop_after and time.perf_counter() - started > args.stop_after:
            console.print("stopping (resumable)")
            return True
        return False

    for date in dates:
        if date.isoformat() in rows:
            continue
        if stop():
            return
        row = learn_day(date, args, runs)
        rows[row["date"]] = row
        save(rows_path, rows)  # atomic: a kill while writing keeps the days before
        console.print(f"{row['date']}: {row['articles']} articles, {row['runs']['monim-amt']['tokens']} tokens; PPL LM "
                      f"{row['ppl_lm']:.2f}, " + ", ".join(f"{n} {r['ppl']:.2f} ({r['entries']} entries)"
                                                         for n, r in row["runs"].items())
                      + f"; {sum(row['seconds'].values()):.0f} s")
    suite_path, part = suite_files(args.workdir, dates[0], dates[-1])
    if suite_path.exists() and not part.exists():  # reopened: only what this run asks beyond it is measured
        suite_path.replace(part)
    features, memories = next(iter(runs.values())).features, {name: run.memory for name, run in runs.items()}
    if suite(args, features, memories, dates, part, stop) is None:
        return
    part.replace(suite_path)
    report_path.write_text(render([rows[d.isoformat()] for d in dates], json.loads(suite_path.read_text())))
    save(args.out, {"workdir": args.workdir, "rows": [rows[d.isoformat()] for d in dates],
                    "suite": json.loads(suite_path.read_text())}, args)
    console.print(report_path.read_text())
    console.print(f"done: {rows_path}, {suite_path}, {report_path}, {args.out} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
