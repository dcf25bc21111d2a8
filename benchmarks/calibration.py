"""Calibration at full daily volume: is Θ ever worse than the LM on the day's unseen test articles?

Memories learn every training article of each day (no cap by default): FullMem and MoNIM-AMT, each
calibrated the paper's way (the day's validation articles) and the new way (a sample of the day's
training articles searched without their own near-duplicates: "train"); FullMem also with the
sample searched in yesterday's memory ("yesterday"). The LM scores each day's training text once
for all memories. Per day and memory: test PPL (LM alone and Θ), the paired difference of Θ's and the
LM's per-token NLL, against the test set's noise (the standard error of the LM's mean NLL on it:
'*' when the mean change exceeds 1.96 of it) and against its own paired standard error ('·': Θ is
consistently, if slightly, worse), λ, T, whether Θ fell back to the LM ('fb'), MemRate. At the end, the skip rule (θ) on the last FullMem-train memory: share
skipped and PPL on all the test articles (unseen) and on copies of training articles.
Each memory is a run's (monim.run.MemoryRun, its calibration source in `calibrator`, in a
folder of its own); it learns each day the product's way, memorized then calibrated (`memorize`,
`calibrate`: the two stages read apart, since a day's row keeps the calibration's record: its
held-out NLL per rule); the runs share the work directory's feature store (`featurize`).
Resumable: memories and per-day rows live in --workdir; a re-run continues after the last day.
Usage: monim bench calibration [--days 10] [--max-docs N] [--workdir DIR] [--out ...json]
"""

import dataclasses
import json
import math
import time
from pathlib import Path

from benchmarks.harness import first_days, news_parser, save, WORK
import numpy as np
from rich.console import Console
from rich.table import Table

from monim.theta.calibrator import CalibratorConfig
from monim.core.config import RunConfig
from monim.evaluation.evaluate import searched, theta_of
from monim.lm.features import Features
from monim.theta.memory import Memory
from monim.run import make_run
from monim.data.feed import Document

RUNS = {  # name: (policy, calibration source)
    "fullmem/validation": ("fullmem", "validation"),
    "fullmem/train": ("fullmem", "train"),
    "fullmem/yesterday": ("fullmem", "yesterday"),
    "monim-amt/validation": ("monim-amt", "validation"),
    "monim-amt/train": ("monim-amt", "train"),
}


def token_nll(lm, docs: list[Document], memories: dict, cfg: Features, skipped: list | None = None) -> dict[str, np.ndarray]:
    """Per-token NLL of the LM ('lm') and of each memory's Θ on the documents (one LM pass); the skip
    rule's choices are appended to `skipped`, if given."""
    out: dict[str, list] = {"lm": [], **{name: [] for name in memories}}
    for batch in cfg.scores(docs, "test"):
        out["lm"].append(-batch.logp.astype(np.float64))
        for name, memory in memories.items():
            b = searched(lm, batch, memory)
            out[name].append(-theta_of(b, memory).logp)
            if skipped is not None and b.knn_skipped is not None:
                skipped.append(b.knn_skipped)
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in out.items()}


def skip_rule(lm, memory: Memory, docs: list[Document], theta: float, cfg: Features) -> dict:
    """Share of tokens skipped and PPL with the skip rule at θ, against full retrieval (same run)."""
    row = {}
    for label, threshold in (("full", None), ("skip", theta)):
        memory.calibrator_cfg.skip_threshold = threshold
        started, skipped = time.perf_counter(), []
        nll = token_nll(lm, docs, {"m": memory}, cfg, skipped)["m"]
        row |= {f"ppl_{label}": math.exp(nll.mean()), f"seconds_{label}": time.perf_counter() - started}
    row["skipped"] = float(np.concatenate(skipped).mean()) if skipped else 0.0
    memory.calibrator_cfg.skip_threshold = None
    return row


def main(argv: list[str] | None = None) -> None:
    ap = news_parser(__doc__, "calibration")
    ap.set_defaults(max_docs=None)
    ap.add_argument("--workdir", type=Path, default=WORK / "calibration")
    ap.add_argument("--runs", default=",".join(RUNS), help="Comma-separated memories to learn (see RUNS).")
    ap.add_argument("--skip", type=float, default=0.3)
    args = ap.parse_args(argv)
    console = Console(width=180)
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows_path = args.workdir / "rows.json"
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else {}
    runs = {name: make_run(RunConfig(policy=policy, workdir=str(args.workdir), model=args.model, max_docs=args.max_docs,
                                     calibrator={"source": source}), root=args.workdir / name.replace("/", "-"))
            for name, (policy, source) in ((n, RUNS[n]) for n in args.runs.split(","))}
    first = next(iter(runs.values()))
    lm, cfg = first.lm, first.features  # the LM, once per article for every memory (the runs' feature store)
    memories = {name: run.memory for name, run in runs.items()}
    days = first_days(args)
    for day in days:
        date = day.date.isoformat()
        if date in rows and set(runs) <= set(rows[date]["runs"]):
            continue
        started, day = time.perf_counter(), day.capped(first.cfg.max_docs)
        lm_pass = first.featurize(day, ("train",))
        row = {"date": date, "articles": len(day.train), "tokens": lm_pass["tokens"], "lm_seconds": lm_pass["seconds"],
               "twin_groups": day.twin_groups, "runs": {}}
        for name, run in runs.items():
            t = time.perf_counter()
            stats, theta = run.memorize(day), run.calibrate(day)
            memories[name] = memory = run.memory
            row["runs"][name] = {"memrate_day": stats["memrate"], "memrate": stats["memrate_total"],
                                 "entries": stats["entries"], "lam": theta["lam"], "temperature": theta["temperature"],
                                 "nll": theta["summary"].get("nll"), "fallback": memory.fallback,
                                 "seconds": time.perf_counter() - t}
        nll = token_nll(lm, day.test, memories, cfg)
        row["test_tokens"] = len(nll["lm"])
        row["ppl_lm"] = math.exp(nll["lm"].mean())
        row["noise"] = nll["lm"].std(ddof=1) / math.sqrt(len(nll["lm"]))  # se of the mean NLL: the test set's size
        for name in runs:
            diff = nll[name] - nll["lm"]
            paired_se = diff.std(ddof=1) / math.sqrt(len(diff))
            twins = memories[name].has_twin(day.test)
            row["runs"][name] |= {"ppl": math.exp(nll[name].mean()), "diff": diff.mean(), "paired_se": paired_se,
                                  "worse": bool(diff.mean() > 1.96 * row["noise"]),
                                  "worse_paired": bool(diff.mean() > 1.96 * paired_se), "test_twins": int(twins.sum())}
        row["seconds"] = time.perf_counter() - started
        rows[date] = row
        save(rows_path, rows)
        console.print(f"{date}: {row['tokens']} tokens, {row['articles']} articles, LM {row['lm_seconds']:.0f} s, "
                      f"day {row['seconds']:.0f} s; test PPL LM {row['ppl_lm']:.2f}, "
                      + ", ".join(f"{n} {r['ppl']:.2f} (λ {r['lam']}{' fallback' if r['fallback'] else ''})"
                                  for n, r in row["runs"].items()))

    done = [rows[d.date.isoformat()] for d in days if d.date.isoformat() in rows]
    table = Table(title=f"Test PPL at full daily volume: {len(done)} RealTime QA days from {days[0].date}")
    for col in ("day", "tokens", "test tok", "LM", *runs, *(f"MemRate {n}" for n in runs if n.startswith("monim"))):
        table.add_column(col, justify="right")
    for r in done:
        cells = [f"{r['runs'][n]['ppl']:.2f}{'*' if r['runs'][n]['worse'] else '·' if r['runs'][n]['worse_paired'] else ''}"
                 f"{' fb' if r['runs'][n]['fallback'] else ''}" for n in runs]
        table.add_row(r["date"], str(r["tokens"]), str(r["test_tokens"]), f"{r['ppl_lm']:.2f} ±{200 * r['noise']:.0f}%", *cells,
                      *(f"{r['runs'][n]['memrate_day']:.1%}" for n in runs if n.startswith("monim")))
    console.print(table)
    summary = {}
    for name in runs:
        worse = [r["date"] for r in done if r["runs"][name]["worse"]]
        paired = [r["date"] for r in done if r["runs"][name]["worse_paired"]]
        diffs = np.array([r["runs"][name]["diff"] for r in done])
        tokens = np.array([r["test_tokens"] for r in done])
        summary[name] = {"days_worse": worse, "days_worse_paired": paired, "mean_nll_change": float((diffs * tokens).sum() / tokens.sum()),
                         "ppl_all_days": math.exp(sum(math.log(r["runs"][name]["ppl"]) * r["test_tokens"] for r in done)
                                                  / tokens.sum()),
                         "memrate": done[-1]["runs"][name]["memrate"]}
        console.print(f"{name}: Θ worse than the LM beyond the test set's noise on {len(worse)} of {len(done)} days "
                      f"{worse}, consistently worse token by token (paired) on {len(paired)}; "
                      f"PPL over all test tokens {summary[name]['ppl_all_days']:.2f}, "
                      f"final MemRate {summary[name]['memrate']:.1%}")
    ppl_lm = math.exp(sum(math.log(r["ppl_lm"]) * r["test_tokens"] for r in done) / sum(r["test_tokens"] for r in done))
    console.print(f"LM alone: PPL over all test tokens {ppl_lm:.2f}")
    result = {"days": rows, "summary": summary, "ppl_lm": ppl_lm}
    if "fullmem/train" in runs and done:
        memory = memories["fullmem/train"]
        memory.settings = dataclasses.replace(memory.settings, calibrator=CalibratorConfig(source="train"))
        unseen = [d for day in days for d in day.test]
        cut = lambda doc: lm.tokenizer.decode(lm.tokenizer(doc.text)["input_ids"][:512])  # noqa: E731
        copies = [Document(f"copy-{d.id}", d.date, cut(d)) for day in days for d in day.train[:1]]
        result["skip"] = {"unseen": skip_rule(lm, memory, unseen, args.skip, cfg),
                          "copies": skip_rule(lm, memory, copies, args.skip, cfg)}
        for kind, r in result["skip"].items():
            console.print(f"skip θ={args.skip} on {kind} articles: {r['skipped']:.1%} of tokens skipped, PPL "
                          f"{r['ppl_full']:.2f} → {r['ppl_skip']:.2f}, time {r['seconds_skip'] / r['seconds_full']:.2f}×")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, result, args, default=float)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
