"""MoNIM-AMT's decision searches as its search rules leave tokens to the LM alone
(monim.core.config.PolicyConfig.search_margin and search_context).

Consecutive days of a stream, every article, learned through the product's own run
(monim.run.MemoryRun.day: featurize, memorize, calibrate, evaluate) by one memory per variant, all
reading one feature store (the LM runs once per article). A variant is a margin ("none": no margin),
"+context" where the context rule is on. Per day and variant: the share of training tokens the
decision searched, the tokens left to the LM alone and the error measured on their probes, MemRate,
test PPL and the seconds of each stage; at the end, each variant against searching every token the
memory could flip (the first variant, "none"). Resumable: WORKDIR keeps the memories, features and
the JSON (a day done is not redone).
Usage: monim bench decision [--source FILE] [--start 2022-06-01] [--days 4] [--variants none,1.0+context]
"""

import datetime as dt
import json
import math
from pathlib import Path

from benchmarks.harness import RTQA, parser, resume, save, WORK
from rich.console import Console
from rich.table import Table

from monim.core.config import RunConfig
from monim.run import make_run
from monim.data.stream import list_dates

KEPT = ("tokens_seen", "memrate_day", "memrate", "entries", "memory_bytes", "ppl", "ppl_lm", "decision_searched",
        "decision_settled", "decision_probed", "decision_probe_flipped", "seconds_featurize", "seconds_learn",
        "seconds_lm_and_search", "seconds_search", "calibrator_seconds")


def variant(spec: str) -> dict:
    """The policy fields of a variant: "none" or a margin, "+context" where the context rule is on."""
    margin, _, context = spec.partition("+")
    if context not in ("", "context"):
        raise ValueError(f"variant {spec!r}: expected MARGIN or MARGIN+context (MARGIN a number or none)")
    return {"search_margin": None if margin == "none" else float(margin), "search_context": bool(context)}


def summary(rows: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant over the days learned by all: tokens searched, the LM-alone error estimate, MemRate
    and PPL (the days' geometric mean)."""
    out = {}
    for name, days in rows.items():
        seen = sum(r["tokens_seen"] for r in days)
        got = lambda r, k: r.get(k) or 0  # noqa: E731  (None: a first day, nothing to search)
        searched = sum(got(r, "decision_searched") for r in days)
        left = sum(got(r, "decision_settled") - got(r, "decision_probed") for r in days)
        probed = sum(got(r, "decision_probed") for r in days)
        flip_rate = sum(got(r, "decision_probe_flipped") for r in days) / probed if probed else 0.0
        searchable = sum(r["tokens_seen"] for r in days if r.get("decision_searched") is not None)
        out[name] = {"days": len(days), "tokens_seen": seen, "searched_share": searched / searchable if searchable else 0.0,
                     "left_to_lm": left, "est_decision_errors": round(left * flip_rate), "memrate": days[-1]["memrate"],
                     "ppl_last": days[-1]["ppl"], "ppl_mean": math.exp(sum(math.log(r["ppl"]) for r in days) / len(days)),
                     "seconds_search": sum(got(r, "seconds_search") for r in days),
                     "seconds_learn": sum(r["seconds_learn"] for r in days),
                     "seconds_featurize": sum(r["seconds_featurize"] for r in days)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "decision")
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--days", type=int, default=4)
    ap.add_argument("--variants", default="none,1.0+context",
                    help="comma-separated: a search margin (none: no margin), +context for the context rule")
    ap.add_argument("--workdir", type=Path, default=WORK / "decision-search")
    args = ap.parse_args(argv)
    dates = list_dates(args.source, start=args.start)[: args.days]
    out = resume(args.out, {"rows": {}})
    out |= {"source": args.source.name, "dates": [d.isoformat() for d in dates]}
    for spec in args.variants.split(","):
        name = f"margin-{spec}"
        cfg = RunConfig(source=str(args.source), workdir=str(args.workdir), policy="monim-amt", **variant(spec))
        run = make_run(cfg, root=args.workdir / "memories" / name)
        done = out["rows"].setdefault(name, [])
        for step, date in enumerate(dates):
            if any(r["date"] == date.isoformat() for r in done):
                continue
            row = run.day(date, step)
            done.append({"date": row["date"]} | {k: row.get(k) for k in KEPT})
            print(json.dumps(done[-1]), flush=True)
            save(args.out, out, args)  # after each day: a stopped run resumes here
    common = min(len(v) for v in out["rows"].values())
    out["summary"] = summary({k: v[:common] for k, v in out["rows"].items()})
    save(args.out, out, args)
    table = Table(title=f"MoNIM-AMT's decision searches, {args.source.name}, {common} days")
    columns = ["searched_share", "left_to_lm", "est_decision_errors", "memrate", "ppl_mean", "seconds_search", "seconds_learn"]
    for c in ["variant", *columns]:
        table.add_column(c)
    for name, s in out["summary"].items():
        table.add_row(name, *(f"{s[c]:.4g}" for c in columns))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
