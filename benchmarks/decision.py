"""MoNIM's decision: its cost onto a large memory, the searches its rules leave, the share none can change.

MoNIM's decision (which tokens it stores): its cost onto a large memory, the searches its rules leave to
the LM alone, and the share no memory can change. Three studies (--study), each with its result JSON:

scale: MoNIM's decision onto a large memory (issue 47's goal: a 100k-token day onto 5M entries, its
decision at most 0.5x the day's LM seconds), projected to 100M entries.

A real dense day (Reuters 1987-03-03: 96,604 training tokens) is memorized by MoNIM-AMT through the
product's run (the flow's ingest, MemoryRun.featurize for its LM pass, then MemoryRun.memorize) onto a
memory that holds synthetic keys first, as `monim bench index-scale` makes them (576 dims, clustered
like SmolLM2-135M's, drifting topics; random next tokens), committed 500k a day and indexed as
memorize_day indexes (IVF-PQ past its exact limit). At each size in --at the day is memorized, its
decision measured (the searches of the tokens the LM alone does not settle, and Θ's rule on them),
then forgotten, and the memory grows on. The LM's seconds are the day's own pass, run once and kept.
A search scans `nprobe` lists of about 4 sqrt(entries) (at most `max_nlist`, 4,096), so its cost
grows with the codes it scans: the projection to 100M fits seconds per searched token = a + b x codes
scanned (entries x nprobe / lists) through the measured sizes, at 4,096 lists.
Resumable: WORKDIR keeps the memory, the feature store and the JSON.
Usage: monim bench decision --study scale [--source FILE] [--date 1987-03-03] [--at 1000000,5000000]

search: MoNIM-AMT's decision searches as its search rules leave tokens to the LM alone
(monim.core.config.PolicyConfig.search_margin and search_context).

Consecutive days of a stream, every article, learned through the product's own run
(monim.run.MemoryRun.day: featurize, memorize, calibrate, evaluate) by one memory per variant, all
reading one feature store (the LM runs once per article). A variant is a margin ("none": no margin),
"+context" where the context rule is on. Per day and variant: the share of training tokens the
decision searched, the tokens left to the LM alone and the error measured on their probes, MemRate,
test PPL and the seconds of each stage; at the end, each variant against searching every token the
memory could flip (the first variant, "none"). Resumable: WORKDIR keeps the memories, features and
the JSON (a day done is not redone).
Usage: monim bench decision --study search [--source FILE] [--start 2022-06-01] [--days 4] [--variants none,1.0+context]

skip: How many of a day's training tokens MoNIM must search the memory for: the share whose decision
no memory can change (monim.learning.policies.MoNIM.certain), by the largest λ Θ may give.

From the LM's statistics alone (one LM pass over the day's training articles; no memory needed):
per λ_max, the share of tokens stored for sure, skipped for sure and certain, under AMT (and the
fixed δ for comparison). (The tokens' LM log p and max log p that `monim bench gpu` draws from:
tools/lm_stats.py.)
Usage: monim bench decision --study skip [--start 2022-06-01] [--max-docs N] [--delta -1.5]
"""

import datetime as dt
import json
import math
import time
from pathlib import Path

from benchmarks.harness import RESULTS, REUTERS, RTQA, WORK, first_days, parser, resume, save
import numpy as np
from benchmarks.index_scale import Keys
from rich.console import Console
from rich.table import Table

from monim.core.config import ScoreConfig

from monim.core.run_config import RunConfig
from monim.data.stream import list_dates
from monim.learning.policies import MoNIM
from monim.lm.features import Features
from monim.lm.model import load_lm
from monim.run import make_run
from monim.storage.entries import Entries
from monim.storage.lexical import day_counts
from monim.theta.calibrator import LAM_CEIL

DAY = 500_000  # synthetic keys committed a day
GOAL = 0.5  # the decision's seconds against the day's LM seconds, at 5M entries
START = dt.date(1987, 1, 1)  # the synthetic days come before the real one


def grow(run, target: int, keys: Keys) -> list[dict]:
    """Commit synthetic days until the memory holds `target` entries; each day's index update."""
    memory, days = run.memory, []
    vocab = len(memory.lm.tokenizer)
    while len(memory) < target:
        t, n = len(memory.ds.days), min(DAY, target - len(memory))
        rng = np.random.default_rng(t)
        with memory.writing():
            memory.ds.commits.commit_day(START + dt.timedelta(days=t), Entries(
                keys.day(t, n, seed=1000 + t).astype(np.float16), rng.integers(0, vocab, n).astype(np.int32),
                [f"synthetic-{t}"] * n, np.arange(n)), n, "synthetic", text=day_counts([]))
            stats = memory.sync()
        days.append({"entries": len(memory), "kind": memory.index.meta["kind"], "nlist": memory.index.meta.get("nlist"),
                     "rebuilt": stats["rebuilt"], "index_s": stats["seconds"]})
        print(json.dumps(days[-1]), flush=True)
    return days


def decide(run, day) -> dict:
    """Memorize the real day onto the memory as it is, then forget it; the decision's costs."""
    memory = run.memory
    entries = len(memory)
    stats = run.memorize(day)
    with memory.writing():
        memory.ds.commits.forget(days=[day.date.isoformat()])
        memory.sync()
    seconds = stats["seconds"]
    return {"entries": entries, "nlist": memory.index.meta.get("nlist"), "tokens": stats["tokens_seen"],
            "searched": stats["searched"], "search_s": seconds["search"], "policy_s": seconds["policy"],
            "decision_s": seconds["search"] + seconds["policy"], "memrate": stats["memrate"]}


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


LAM_MAXES = (0.1, 0.25, 0.5, LAM_CEIL)


def scale(args) -> None:
    """The decision's seconds onto memories of --at entries, against the day's LM seconds."""
    out = resume(args.out, {"sizes": [], "growth": []})
    run = make_run(RunConfig(source=str(args.source), workdir=str(args.workdir), policy="monim-amt"))
    day = run.ingest(args.date)
    if "lm_s" not in out:  # the day's own LM pass, once (the store keeps its features)
        lm = run.featurize(day, ("train",))
        out |= {"source": args.source.name, "date": args.date.isoformat(), "lm_s": lm["seconds"], "lm_tokens": lm["tokens"]}
        save(args.out, out, args)
    keys = Keys()
    for size in (int(s) for s in args.at.split(",")):
        if any(s["target"] == size for s in out["sizes"]):
            continue
        out["growth"] += grow(run, size, keys)
        row = decide(run, day) | {"target": size}
        row["decision_vs_lm"] = row["decision_s"] / out["lm_s"]
        out["sizes"].append(row)
        print(json.dumps(row), flush=True)
        save(args.out, out, args)
    if len(out["sizes"]) >= 2:  # seconds per searched token = a + b x codes a search scans (entries x nprobe / lists)
        nprobe = run.memory.index.cfg.nprobe
        codes = np.array([s["entries"] * nprobe / s["nlist"] for s in out["sizes"]])
        b, a = np.polyfit(codes, [s["search_s"] / s["searched"] for s in out["sizes"]], 1)
        last, lists = out["sizes"][-1], run.memory.index.cfg.max_nlist  # 100M entries: lists at their cap
        search_100m = (a + b * 1e8 * nprobe / lists) * last["searched"]
        out["projection_100m"] = {"lists": lists, "per_searched_token_s": search_100m / last["searched"], "search_s": search_100m,
                                  "decision_vs_lm": (search_100m + last["policy_s"]) / out["lm_s"]}
        save(args.out, out, args)
    table = Table(title=f"MoNIM-AMT's decision on {out['date']} ({out['lm_tokens']:,} LM tokens, "
                        f"{out['lm_s']:.0f} s) onto a memory of synthetic keys, 2 cores")
    for c in ("entries", "lists", "searched", "search s", "rule s", "decision / LM", f"goal {GOAL}x"):
        table.add_column(c, justify="right")
    for s in out["sizes"]:
        table.add_row(f"{s['entries']:,}", f"{s['nlist']:,}", f"{s['searched'] / s['tokens']:.0%}", f"{s['search_s']:.0f}",
                      f"{s['policy_s']:.0f}", f"{s['decision_vs_lm']:.2f}x", "met" if s["decision_vs_lm"] <= GOAL else "not met")
    if "projection_100m" in out:
        p = out["projection_100m"]
        table.add_row("100M (projected)", f"{p['lists']:,}", "", f"{p['search_s']:.0f}", "", f"{p['decision_vs_lm']:.2f}x", "")
    Console(width=130).print(table)


def search(args) -> None:
    """Per variant of the search rules: the tokens searched, those left to the LM alone, MemRate and PPL."""
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


def lm_stats(lm, docs, name: str) -> tuple[np.ndarray, np.ndarray, float]:
    """The LM's log p and max log p of the articles' tokens, and the LM pass's seconds."""
    started = time.perf_counter()
    batches = list(Features(lm, ScoreConfig()).scores(docs, name))
    seconds = time.perf_counter() - started
    return np.concatenate([b.logp for b in batches]), np.concatenate([b.max_logp for b in batches]), seconds


def skip(args) -> None:
    """Per λ_max, the share of a day's training tokens stored, skipped and certain whatever the memory."""
    lm = load_lm(args.model)
    day = first_days(args)[0]
    docs = day.train[: args.max_docs]
    logp, max_logp, seconds = lm_stats(lm, docs, f"{day.date}-train")
    rows = []
    for adaptive in (True, False):
        policy = MoNIM(args.delta, adaptive)
        lm_alone = policy.decided(logp, max_logp, 0.0)[0].mean()
        for lam_max in LAM_MAXES:
            store, skip = policy.decided(logp, max_logp, lam_max)
            rows.append({"rule": policy.name, "lam_max": lam_max, "certain": float((store | skip).mean()),
                         "store": float(store.mean()), "skip": float(skip.mean()), "memrate_lm": float(lm_alone)})
    table = Table("rule", "λ_max", "certain", "stored for sure", "skipped for sure", "MemRate (LM alone)",
                  title=f"{day.date}: {len(logp)} training tokens of {len(docs)} articles, δ = {args.delta}")
    for r in rows:
        table.add_row(r["rule"], f"{r['lam_max']:g}", f"{r['certain']:.1%}", f"{r['store']:.1%}", f"{r['skip']:.1%}",
                      f"{r['memrate_lm']:.1%}")
    Console(width=120).print(table)
    save(args.out, {"model": lm.name, "date": day.date.isoformat(), "articles": len(docs),
                    "articles_in_day": len(day.train), "tokens": len(logp), "delta": args.delta, "lm_seconds": seconds,
                    "rows": rows}, args)


STUDIES = {"scale": scale, "search": search, "skip": skip}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "decision")
    ap.add_argument("--study", choices=STUDIES, default="search")
    ap.add_argument("--source", type=Path, default=None, help="the stream (scale: Reuters; search, skip: RealTime QA)")
    ap.set_defaults(out=None)  # docs/results/decision/decision-STUDY.json
    ap.add_argument("--workdir", type=Path, default=None, help="scale, search: the work directory (resumable)")
    ap.add_argument("--date", type=dt.date.fromisoformat, default=dt.date(1987, 3, 3), help="scale: the real day")
    ap.add_argument("--at", default="1000000,5000000", help="scale: memory sizes (entries) to decide the day onto")
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1), help="search, skip: the first day")
    ap.add_argument("--days", type=int, default=None, help="search: days (4); skip: its first day only")
    ap.add_argument("--variants", default="none,1.0+context",
                    help="search: comma-separated: a search margin (none: no margin), +context for the context rule")
    ap.add_argument("--max-docs", type=int, default=None, help="skip: the day's first N training articles (all)")
    ap.add_argument("--model", default=None, help="skip: the LM")
    ap.add_argument("--delta", type=float, default=-1.5, help="skip: the fixed δ compared with AMT")
    args = ap.parse_args(argv)
    args.source = args.source or (REUTERS if args.study == "scale" else RTQA)
    args.out = args.out or RESULTS / "decision" / f"decision-{args.study}.json"
    args.workdir = args.workdir or WORK / f"decision-{args.study}"
    args.days = args.days or (4 if args.study == "search" else 1)
    STUDIES[args.study](args)


if __name__ == "__main__":
    main()
