"""The index codecs on a real memory: PPL with exact search, fast-scan and IVF-PQ codes, add and search time.

The index codecs on a real memory: PPL of LM + memory with exact search, the fast-scan codes and
the paper's IVF-PQ codes, on the same memory and the same held-out articles, with add and search time.

A FullMem memory learns every training article of the first --days weekdays of the dense Reuters
stream (the real LM, ~100k tokens a day) through the library's run (monim.run.MemoryRun.memorize,
exact search); its index is rebuilt with each codec in turn; the next day's first --eval-docs training
articles (never memorized) are scored with each, under the same constant λ and temperature (the
defaults: the days are memorized, not calibrated, so that no calibration tunes Θ, or makes it fall
back to the LM alone, between the codecs and the memory). Search time is the evaluation's kNN time (k = 1024).
Usage: monim bench index-codecs [--days 2] [--eval-docs 40]
"""

import datetime as dt
import json
import time
from pathlib import Path

from benchmarks.harness import REUTERS, WORK, parser, save
from rich.console import Console
from rich.table import Table

from monim.core.run_config import RunConfig
from monim.evaluation.evaluate import evaluate
from monim.storage.index import IndexConfig
from monim.theta.memory import Memory
from monim.run import make_run
from monim.storage.memory_settings import Settings
from monim.data.feed import open_feed
from monim.data.stream import iter_days, list_dates

EXACT = 1 << 40  # exact_below: never IVF


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "index-codecs")
    ap.add_argument("--source", default=str(REUTERS))
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(1987, 3, 2))
    ap.add_argument("--days", type=int, default=2)
    ap.add_argument("--eval-docs", type=int, default=40)
    ap.add_argument("--workdir", type=Path, default=WORK / "index-codecs")
    args = ap.parse_args(argv)
    run = make_run(RunConfig(source=args.source, workdir=str(args.workdir), policy="fullmem", calibrated=False,
                             exact_below=EXACT), root=args.workdir / "fullmem")  # its features: WORKDIR/features
    lm, features = run.lm, run.features
    dates = [d for d in list_dates(args.source, args.start) if d.weekday() < 5]
    learn, held = dates[: args.days], dates[args.days]
    for day in iter_days(open_feed(args.source), learn[0], learn[-1]):
        if day.date in learn:
            run.memorize(day)
    docs = next(iter_days(open_feed(args.source), held, held)).train[: args.eval_docs]
    rows = []
    for label, cfg in [("exact", IndexConfig(exact_below=EXACT)), ("fastscan", IndexConfig(exact_below=0, codec="fastscan")),
                       ("pq", IndexConfig(exact_below=0, codec="pq"))]:
        view = Memory(args.workdir / "fullmem", lm, Settings(calibrated=False, index=cfg), may_differ=set(Settings().flat()))  # rebuilt with each codec
        started = time.perf_counter()
        view.sync(retrain=True)
        build = time.perf_counter() - started
        started = time.perf_counter()  # the LM's features come from the store: this is the searches
        result = evaluate(lm, docs, view, features, f"{held}-eval")
        rows.append({"index": label, "entries": len(view), "build_s": build, "search_s": time.perf_counter() - started,
                     "ppl": result["ppl"], "ppl_lm": result["ppl_lm"], "tokens": result["tokens"],
                     "codec": view.index.meta.get("codec", "exact"), "nlist": view.index.meta.get("nlist", 0)})
        print(json.dumps(rows[-1]), flush=True)
    exact = rows[0]["ppl"]
    table = Table(title=f"Index codecs on a real FullMem memory ({rows[0]['entries']:,} entries, Reuters "
                        f"{learn[0]}..{learn[-1]}), {rows[0]['tokens']:,} held-out tokens of {held}; LM alone {rows[0]['ppl_lm']:.3f}")
    for col in ("index", "nlist", "build s", "search s", "PPL", "vs exact"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["index"], str(r["nlist"]), f"{r['build_s']:.1f}", f"{r['search_s']:.1f}", f"{r['ppl']:.3f}",
                      f"{r['ppl'] / exact - 1:+.2%}")
    Console(width=130).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, rows, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
