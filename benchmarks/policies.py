"""FullMem, RandMem and MoNIM-AMT over days of news: each memory's bytes, seconds, MemRate and PPL.

FullMem, RandMem (at MoNIM's MemRate) and MoNIM-AMT over days of a real news stream: what each memory
costs and what it gives. Two studies (--study), each with its result JSON:

cost: MoNIM's promise in bytes and seconds: FullMem, RandMem (at MoNIM's MemRate) and MoNIM-AMT over
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
Usage: monim bench policies --study cost --days 7 [--features DIR] [--variants k_decide=32,k_decide=128]

live: FullMem vs RandMem vs MoNIM-AMT over consecutive days of a real news stream (CPU-sized).

Per policy: cumulative MemRate, test PPL of the bare LM and of LM + memory (constant λ and T tuned
on the validation split), memory bytes, the memorization pass's throughput as a ratio to the bare
LM's forward pass over the same tokens (measured in this same run), and the index update time per
day as the memory grows. Each policy is a run (monim.run.MemoryRun, Θ with the constant λ) that
learns every day the product's way (`learn`: memorize, then calibrate), the LM live (no feature
store, so each pass includes the LM's). RandMem stores at MoNIM's MemRate (monim.core.catalogue.
followed_memrate), so MoNIM runs first.
Usage: monim bench policies --study live [--days 10] [--max-docs 8] [--out ...json]
"""

import datetime as dt
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, RTQA, WORK, first_days, parser, save
from rich.console import Console
from rich.table import Table

from monim.core.catalogue import followed_memrate
from monim.core.run_config import RunConfig
from monim.data.stream import list_dates, read_day
from monim.evaluation.evaluate import evaluate_many
from monim.learning.policies import run_policy
from monim.lm.features import Features
from monim.lm.model import cached_lm
from monim.lm.scoring import score
from monim.run import MemoryRun, make_run
from monim.storage.memory_settings import Settings
from monim.storage.workdirs import memory_status
from monim.theta.knnlm import perplexity, tune_interpolation

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


def day_stats(date: str, row: dict) -> dict:
    """What memorizing the day did, from the run's row of the day (seconds by stage)."""
    return {"date": date, "tokens_seen": row["tokens_seen"], "stored": row["entries_stored"],
            "memrate": row["memrate_day"], "seconds": {k.removeprefix("seconds_"): v for k, v in row.items()
                                                       if k.startswith("seconds_")}}


def cost(args) -> None:
    """Per day and memory at full volume: entries, bytes, learning seconds by stage beyond the LM, test PPL."""
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


def live(args) -> None:
    """Per policy, the LM live: MemRate, PPL, bytes and the memorization pass against the bare LM's."""
    work = Path(tempfile.mkdtemp(prefix="monim-bench-"))
    config = {"workdir": str(work), "model": args.model, "calibrated": False, "k": args.k,  # constant λ: see calibration --study calibrator
              "feature_store": False, "max_docs": args.max_docs}
    lm = cached_lm(args.model)  # the runs' LM (one per process)
    window = RunConfig(**config).window()
    days = first_days(args)
    console = Console(width=150)

    # the baseline: the bare LM's forward pass over the same training tokens, per day
    bare_seconds = []
    for day in days:
        t = time.perf_counter()
        sum(len(b) for b in score(lm, day.capped(args.max_docs).train, window))
        bare_seconds.append(time.perf_counter() - t)
    console.print(f"bare LM pass: {sum(bare_seconds):.0f} s over {len(days)} days")
    validation = [d for day in days for d in day.validation]
    test = [d for day in days for d in day.test]
    bare_test = list(score(lm, test, window))

    results = {"model": lm.name, "days": [d.date.isoformat() for d in days], "max_docs": args.max_docs,
               "k": args.k, "bare_ppl": perplexity(bare_test), "policies": {}}
    for name in BASE:
        follows = followed_memrate(name, {p: r["memrate"] for p, r in results["policies"].items()})
        run = make_run(RunConfig(policy=name, followed_memrate=follows, **config))
        rows = []
        for step, (day, bare) in enumerate(zip(days, bare_seconds)):
            row = run.learn(day.capped(run.cfg.max_docs), step)  # the next day's Θ calibrated too
            stats = day_stats(day.date.isoformat(), row)
            pass_seconds = stats["seconds"]["lm_and_search"] + stats["seconds"]["policy"]
            rows.append(stats | {"entries_total": row["entries"], "bare_seconds": bare,
                                 "throughput_ratio": bare / pass_seconds})
            console.print(f"{name} {stats['date']}: stored {stats['stored']}/{stats['tokens_seen']} "
                          f"({stats['memrate']:.0%}), memory {row['entries']}, pass {pass_seconds:.1f}s vs bare "
                          f"{bare:.1f}s, index {stats['seconds']['index']:.2f}s")
        memory = run.memory
        interp, _ = tune_interpolation(memory.score(validation, retrieve=True))
        seen = sum(r["tokens_seen"] for r in rows)
        results["policies"][name] = {
            "params": vars(run_policy(run.cfg)), "memrate": len(memory) / seen, "entries": len(memory),
            "tokens_seen": seen, "test_ppl": perplexity(memory.score(test, retrieve=True), interp), "lam": interp.lam,
            "temperature": interp.temperature, "bytes": memory.bytes_on_disk(),
            "throughput_ratio": sum(r["bare_seconds"] for r in rows)
            / sum(r["seconds"]["lm_and_search"] + r["seconds"]["policy"] for r in rows),
            "days": rows,
        }
    shutil.rmtree(work)

    table = Table(title=f"{len(days)} days from {days[0].date}, <= {args.max_docs} training articles a day, "
                        f"{len(test)} test articles; bare LM test PPL {results['bare_ppl']:.2f}")
    for col in ("policy", "MemRate", "entries", "test PPL", "λ", "T", "MB", "pass/bare-LM throughput"):
        table.add_column(col, justify="right")
    for name, r in results["policies"].items():
        table.add_row(name, f"{r['memrate']:.1%}", str(r["entries"]), f"{r['test_ppl']:.2f}", f"{r['lam']:.2f}",
                      f"{r['temperature']:g}", f"{r['bytes'] / 2**20:.1f}", f"{r['throughput_ratio']:.2f}")
    console.print(table)
    daily = Table(title="per day: MemRate of the day, and index update seconds at the memory size reached")
    daily.add_column("day")
    for name in results["policies"]:
        daily.add_column(f"{name} MemRate", justify="right")
        daily.add_column(f"{name} entries / index s", justify="right")
    for i, date in enumerate(results["days"]):
        cells = []
        for r in results["policies"].values():
            row = r["days"][i]
            cells += [f"{row['memrate']:.1%}", f"{row['entries_total']} / {row['seconds']['index']:.2f}"]
        daily.add_row(date, *cells)
    console.print(daily)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, results, args, default=str)
    console.print(f"wrote {args.out}")


STUDIES = {"cost": cost, "live": live}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "policies")
    ap.add_argument("--study", choices=STUDIES, default="cost")
    ap.set_defaults(out=None)  # docs/results/policies/policies-STUDY.json
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--days", type=int, default=None, help="cost: 7; live: 10")
    ap.add_argument("--model", default=None)
    ap.add_argument("--workdir", type=Path, default=WORK / "memory-cost", help="cost: the memories and rows (resumable)")
    ap.add_argument("--features", type=Path, default=None, help="cost: a feature store to read (default: WORKDIR/features).")
    ap.add_argument("--variants", default="", help="cost: more MoNIM-AMT memories, comma-separated IndexConfig changes: "
                                                   "k_decide=32,k_decide=128,exact_below=50000")
    ap.add_argument("--max-docs", type=int, default=8, help="live: training articles a day")
    ap.add_argument("--k", type=int, default=1024, help="live: the kNN's k")
    args = ap.parse_args(argv)
    args.out = args.out or RESULTS / "policies" / f"policies-{args.study}.json"
    args.days = args.days or (7 if args.study == "cost" else 10)
    STUDIES[args.study](args)


if __name__ == "__main__":
    main()
