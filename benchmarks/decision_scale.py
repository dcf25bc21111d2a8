"""MoNIM's decision onto a large memory (issue 47's goal: a 100k-token day onto 5M entries, its
decision at most 0.5x the day's LM seconds), projected to 100M entries.

A real dense day (Reuters 1987-03-03: 96,604 training tokens) is memorized by MoNIM-AMT through the
product's run (the flow's ingest, MemoryRun.featurize for its LM pass, then MemoryRun.memorize) onto a
memory that holds synthetic keys first, as benchmarks/index_scale.py makes them (576 dims, clustered
like SmolLM2-135M's, drifting topics; random next tokens), committed 500k a day and indexed as
memorize_day indexes (IVF-PQ past its exact limit). At each size in --at the day is memorized, its
decision measured (the searches of the tokens the LM alone does not settle, and Θ's rule on them),
then forgotten, and the memory grows on. The LM's seconds are the day's own pass, run once and kept.
A search scans `nprobe` lists of about 4 sqrt(entries) (at most `max_nlist`, 4,096), so its cost
grows with the codes it scans: the projection to 100M fits seconds per searched token = a + b x codes
scanned (entries x nprobe / lists) through the measured sizes, at 4,096 lists.
Resumable: WORKDIR keeps the memory, the feature store and the JSON.
Usage: monim bench decision [--source FILE] [--date 1987-03-03] [--at 1000000,5000000]
"""

import datetime as dt
import json
from pathlib import Path

from benchmarks.harness import REPO, parser, resume, save, WORK
import numpy as np
from benchmarks.index_scale import Keys
from rich.console import Console
from rich.table import Table

from monim.core.config import RunConfig
from monim.storage.entries import Entries
from monim.storage.lexical import day_counts
from monim.run import make_run

RTQA = REPO.parent / "shared" / "data" / "news" / "reuters21578.jsonl.gz"
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


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "decision")
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--date", type=dt.date.fromisoformat, default=dt.date(1987, 3, 3))
    ap.add_argument("--at", default="1000000,5000000", help="memory sizes (entries) to decide the day onto")
    ap.add_argument("--workdir", type=Path, default=WORK / "decision-scale")
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    main()
