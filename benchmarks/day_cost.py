"""What a full-volume day costs beside its LM pass (issue 47's evidence).

Consecutive days of a stream, every article, learned through the product's run
(the day as the flow's ingest reads it, then monim.run.MemoryRun.day: featurize, memorize,
calibrate, evaluate, record) by each policy in turn
(RandMem at MoNIM-AMT's MemRate so far, as `monim compare` sets it), all reading one feature store:
the first policy's featurize is the day's LM pass (train, validation and test articles), the LM's
seconds every ratio is taken against. Per day and policy: memorize (its search apart), calibrate,
evaluate and the whole day, each as seconds and as a ratio to the LM's; the share of training tokens
MoNIM's decision searched. Per day: one policy's day (LM + its stages) and all policies' (LM once +
every policy's stages) against the LM, and MoNIM-AMT's learning against FullMem's, beside issue 47's
goals (1.25x, 1.5x, 1.1x). Resumable: WORKDIR keeps the memories, features and the JSON (a day done
is not redone; a day is done when every policy learned it). `--lm-from` an earlier run's JSON takes the
LM's seconds from it, for a rerun whose feature store that run filled (its own LM pass then reads the store).
Usage: python benchmarks/day_cost.py [--source FILE] [--start 2022-06-01] [--days 7] [--policies monim-amt,fullmem,randmem]
[--max-docs N] [--lm-from JSON] [--exact-below N]
"""

import datetime as dt
import json
import time
from pathlib import Path

import monim  # noqa: F401  (OMP_WAIT_POLICY before torch)
from rich.console import Console
from rich.table import Table

from monim.core import catalogue
from monim.core.config import RunConfig
from monim.run import make_run
from monim.data.stream import list_dates
from harness import RESULTS, RTQA, parser, resume, save

MEMORIZE = ("lm_and_search", "policy", "merge", "commit", "index")  # MemoryRun's memorize stages (DayStats.seconds)
GOALS = {"one": 1.25, "all": 1.5, "monim_vs_fullmem": 1.1}


def stages(row: dict, wall: float) -> dict:
    """A policy's day split into its stages (seconds; the LM's pass apart)."""
    memorize = sum(row.get(f"seconds_{s}", 0.0) for s in MEMORIZE)
    lm = row["seconds_featurize"]
    return {"lm": lm, "memorize": memorize, "search": row.get("seconds_search", 0.0),
            "calibrate": row["seconds_learn"] - memorize, "learn": row["seconds_learn"],
            "evaluate": wall - lm - row["seconds_learn"], "beyond_lm": wall - lm,
            "searched_share": row["decision_searched"] / row["tokens_seen"] if row.get("decision_searched") is not None else None,
            "entries": row["entries"], "memrate": row["memrate"], "ppl": row["ppl"]}


def ratios(day: dict, lm: float | None = None) -> dict:
    """The day's goals: one policy's day and all policies' against the LM (its seconds `lm`, or the
    policies' featurize: the first one's pass, the others read the store), MoNIM's learning against FullMem's."""
    runs = day["runs"]
    lm = lm or sum(r["lm"] for r in runs.values())
    out = {"lm_seconds": lm, "all": (lm + sum(r["beyond_lm"] for r in runs.values())) / lm}
    out |= {f"one_{name}": (lm + r["beyond_lm"]) / lm for name, r in runs.items()}
    if "monim-amt" in runs and "fullmem" in runs:
        out["monim_vs_fullmem"] = runs["monim-amt"]["learn"] / runs["fullmem"]["learn"]
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--policies", default="monim-amt,fullmem,randmem", help="comma-separated; MoNIM before RandMem")
    ap.add_argument("--max-docs", type=int, default=None, help="training articles a day (default: every one)")
    ap.add_argument("--workdir", type=Path, default=RESULTS / "day-cost-work")
    ap.add_argument("--out", type=Path, default=RESULTS / "day-cost.json")
    ap.add_argument("--lm-from", type=Path, default=None, help="an earlier run's JSON: the LM's seconds per day")
    ap.add_argument("--exact-below", type=int, default=RunConfig.model_fields["exact_below"].default,
                    help="RunConfig.exact_below of every policy's memory")
    args = ap.parse_args()
    lm_seconds = {d["date"]: d["ratios"]["lm_seconds"] for d in json.loads(args.lm_from.read_text())["days"]} \
        if args.lm_from else {}
    dates = list_dates(args.source, start=args.start)[: args.days]
    out = resume(args.out, {"days": []})
    out |= {"source": args.source.name, "policies": args.policies.split(","), "goals": GOALS, "exact_below": args.exact_below}
    runs = {p: make_run(RunConfig(source=str(args.source), workdir=str(args.workdir), policy=p,
                                  max_docs=args.max_docs, exact_below=args.exact_below)) for p in out["policies"]}
    done = {d["date"] for d in out["days"]}
    for step, date in enumerate(dates):
        if date.isoformat() in done:
            continue
        memrates, learned = {}, {}
        for name, run in runs.items():
            follows = catalogue.followed_memrate(name, memrates)
            run.cfg = RunConfig.model_validate(run.cfg.model_dump() | {"followed_memrate": follows})
            started = time.perf_counter()
            row = run.day(date, step)
            learned[name] = stages(row, time.perf_counter() - started)
            memrates[name] = row["memrate"]
        lm = lm_seconds.get(date.isoformat())
        out["days"].append({"date": date.isoformat(), "runs": learned, "ratios": ratios({"runs": learned}, lm)}
                           | ({"lm_from": args.lm_from.name} if lm else {}))
        print(json.dumps(out["days"][-1]["ratios"] | {"date": date.isoformat()}), flush=True)
        save(args.out, out)  # after each day: a stopped run resumes here
    volume = "every article" if args.max_docs is None else f"{args.max_docs} training articles a day"
    table = Table(title=f"A day's cost against its LM pass, {args.source.name}, {volume}")
    names = out["policies"]
    columns = ["LM s", *(f"{n} learn s" for n in names), "MoNIM searched", "one (max)", "all", "MoNIM/FullMem learn"]
    for c in ["day", *columns]:
        table.add_column(c)
    for d in out["days"]:
        r, runs_ = d["ratios"], d["runs"]
        share = runs_.get("monim-amt", {}).get("searched_share")
        table.add_row(d["date"], f"{r['lm_seconds']:.0f}", *(f"{runs_[n]['learn']:.0f}" for n in names),
                      "-" if share is None else f"{share:.0%}", f"{max(r[f'one_{n}'] for n in names):.2f}x",
                      f"{r['all']:.2f}x", f"{r['monim_vs_fullmem']:.2f}x" if "monim_vs_fullmem" in r else "-")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
