"""MoNIM's promise in bytes and seconds: FullMem, RandMem (at MoNIM's MemRate) and MoNIM-AMT over
full-volume days of a stream (every training article), library-level, the LM's features from a
feature store (each token meets the LM once, for every memory: the LM pass is left out of the costs).
Each day is learned through the library's run (monim.run.MemoryRun: memorize, then calibrate, timed
apart), one a memory. RandMem stores at MoNIM-AMT's MemRate over the stream so far, by the catalogue's
one rule (monim.core.catalogue.followed_memrate; until issue 46 it stored at MoNIM-AMT's rate of the day).

Per day and memory: entries, bytes on disk (the memory's own: shards + index; and everything in its
folder, Θ's calibrations included), bytes per entry, the learning seconds beyond the LM pass by stage
(MoNIM's decision searches, the policy, the commit, the index, calibration) and test PPL. With
`--variants`, more MoNIM-AMT memories learned beside them with other index settings (e.g. the k of
the memorization decision): the trade-off of MemRate and PPL against seconds.
Resumable: the work directory keeps the memories and rows.json. Writes a table and JSON.
Usage: monim bench policies --days 7 [--features DIR] [--variants k_decide=32,k_decide=128]
"""

import datetime as dt
import json
import math
import time
from pathlib import Path

from benchmarks.harness import RTQA, parser, save, WORK
from rich.console import Console
from rich.table import Table

from monim.core.catalogue import followed_memrate
from monim.core.config import RunConfig
from monim.evaluation.evaluate import evaluate_many
from monim.lm.features import Features
from monim.storage.workdirs import memory_status
from monim.run import MemoryRun, make_run
from monim.storage.memory_settings import Settings
from monim.data.stream import list_dates, read_day

BASE = ("monim-amt", "fullmem", "randmem")  # MoNIM first: RandMem stores at its MemRate


def variant(spec: str) -> tuple[str, dict]:
    """'k_decide=32' -> ('monim-amt@k_decide=32', {'index.k_decide': 32}): IndexConfig fields joined by '+'."""
    fields = dict(part.split("=") for part in spec.split("+"))
    return f"monim-amt@{spec}", {f"index.{k}": int(v) for k, v in fields.items()}


def open_runs(args, specs: dict[str, dict]) -> dict[str, MemoryRun]:
    """A run a memory, learning into WORKDIR/<its name> with the run's settings and its variant's index
    settings (`specs`: name -> changes); one feature store for all (--features)."""
    runs = {}
    for name, changes in specs.items():
        cfg = RunConfig(source=str(args.source), workdir=str(args.workdir), policy=name.split("@")[0], model=args.model)
        runs[name] = make_run(cfg, settings=Settings.of(cfg).with_(**changes), root=args.workdir / name.replace("=", "-"))
    first = next(iter(runs.values()))
    features = Features(first.lm, first.cfg.window(), args.features) if args.features else first.features
    for run in runs.values():
        run.features = features
    return runs


def learn_day(date: dt.date, source: Path, runs: dict[str, MemoryRun]) -> dict:
    """The day learned by each run (memorize and calibrate, timed apart), its costs and test PPL."""
    day = read_day(source, date)
    first = next(iter(runs.values()))
    row = {"date": date.isoformat(), "articles": len(day.train), "lm_tokens": first.featurize(day)["tokens"], "runs": {}}
    memrates: dict[str, float] = {}
    for name, run in runs.items():  # RandMem follows MoNIM-AMT's MemRate, by the catalogue's rule
        follows = followed_memrate(run.cfg.policy, memrates)
        run.cfg = RunConfig.model_validate(run.cfg.model_dump() | {"followed_memrate": follows})
        t = time.perf_counter()
        stats = run.memorize(day)
        memorized = time.perf_counter() - t
        theta = run.calibrate(day)
        learned = time.perf_counter() - t
        r, memory = MemoryRun.learned(stats, theta), run.memory
        memrates[name] = r["memrate"]
        status = memory_status(memory.ds.root)
        row["runs"][name] = {"tokens": r["tokens_seen"], "stored": r["entries_stored"], "memrate_day": r["memrate_day"],
                             "entries": r["entries"], "memrate": r["memrate"], "bytes": status["bytes"],
                             "bytes_total": status["bytes_total"], "index": memory.index.meta.get("kind"),
                             "seconds": stats["seconds"] | {"memorize": memorized, "calibrate": learned - memorized,
                                                            "learn": learned},
                             "lam": theta["summary"].get("lam"), "fallback": memory.fallback}
    t = time.perf_counter()
    features = first.features
    memories = {name: run.memory for name, run in runs.items()}
    result = evaluate_many(features.lm, day.test, {"bare": None, **memories}, features, f"{date}-test")
    row |= {"test_tokens": result["bare"]["tokens"], "ppl_lm": result["bare"]["ppl_lm"],
            "evaluate_seconds": time.perf_counter() - t}
    for name in memories:
        row["runs"][name] |= {k: result[name][k] for k in ("ppl", "accuracy")}
    return row


def ppl_over(rows: list[dict], name: str) -> float:
    """PPL over every test token of the days."""
    return math.exp(sum(r["test_tokens"] * math.log(r["runs"][name]["ppl"]) for r in rows) / sum(r["test_tokens"] for r in rows))


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "policies")
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--workdir", type=Path, default=WORK / "memory-cost")
    ap.add_argument("--features", type=Path, default=None, help="A feature store to read (default: WORKDIR/features).")
    ap.add_argument("--variants", default="", help="More MoNIM-AMT memories, comma-separated IndexConfig changes: "
                                                   "k_decide=32,k_decide=128,exact_below=50000")
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    console = Console(width=180)
    specs = {name: {} for name in BASE} | dict(variant(v) for v in args.variants.split(",") if v)
    runs = open_runs(args, specs)
    rows_path = args.workdir / "rows.json"
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else {}
    dates = list_dates(args.source, args.start)[: args.days]
    for date in dates:
        if date.isoformat() in rows and set(runs) <= set(rows[date.isoformat()]["runs"]):
            continue
        rows[date.isoformat()] = learn_day(date, args.source, runs)
        rows_path.parent.mkdir(parents=True, exist_ok=True)
        save(rows_path, rows)
        r = rows[date.isoformat()]
        console.print(f"{date}: " + "; ".join(f"{n} {x['entries']:,} entries, {x['bytes'] / 2**20:.0f} MB, learn "
                                               f"{x['seconds']['learn']:.0f} s, PPL {x['ppl']:.2f}" for n, x in r["runs"].items()))
    done = [rows[d.isoformat()] for d in dates]
    table = Table(title=f"Bytes and seconds, {args.source.name} {dates[0]}..{dates[-1]}, every training article "
                        f"(LM alone {math.exp(sum(r['test_tokens'] * math.log(r['ppl_lm']) for r in done) / sum(r['test_tokens'] for r in done)):.2f})")
    for col in ("day", "memory", "entries", "MB", "B/entry", "MB in all", "vs FullMem MB", "learn s", "search s",
                "policy s", "commit+index s", "calibrate s", "vs FullMem s", "PPL"):
        table.add_column(col, justify="right")
    for r in done:
        full = r["runs"]["fullmem"]
        for name, x in r["runs"].items():
            s = x["seconds"]
            table.add_row(r["date"][5:], name, f"{x['entries']:,}", f"{x['bytes'] / 2**20:.1f}",
                          f"{x['bytes'] / max(x['entries'], 1):.0f}", f"{x['bytes_total'] / 2**20:.1f}",
                          f"{x['bytes'] / full['bytes']:.2f}", f"{s['learn']:.1f}", f"{s.get('search', 0):.1f}",
                          f"{s.get('policy', 0):.1f}", f"{s.get('commit', 0) + s.get('index', 0):.1f}",
                          f"{s['calibrate']:.1f}", f"{s['learn'] / full['seconds']['learn']:.2f}", f"{x['ppl']:.2f}")
    console.print(table)
    summary = {name: {"ppl": ppl_over(done, name), "memrate": done[-1]["runs"][name]["memrate"],
                      "bytes_vs_fullmem_max": max(r["runs"][name]["bytes"] / r["runs"]["fullmem"]["bytes"] for r in done),
                      "learn_seconds": sum(r["runs"][name]["seconds"]["learn"] for r in done),
                      "learn_vs_fullmem": sum(r["runs"][name]["seconds"]["learn"] for r in done)
                      / sum(r["runs"]["fullmem"]["seconds"]["learn"] for r in done)} for name in runs}
    for name, s in summary.items():
        console.print(f"{name}: PPL {s['ppl']:.3f}, MemRate {s['memrate']:.1%}, bytes at most {s['bytes_vs_fullmem_max']:.2f}x "
                      f"FullMem's, learning {s['learn_seconds']:.0f} s = {s['learn_vs_fullmem']:.2f}x FullMem's")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, {"days": done, "summary": summary}, args)


if __name__ == "__main__":
    main()
