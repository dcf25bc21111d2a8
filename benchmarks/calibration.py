"""Θ's calibrator: is Θ ever worse than the LM at full daily volume, and against constant λ by feature group.

The NN calibrator (Θ's λ per token): whether Θ is ever worse than the LM at full daily volume, and the
calibrator against constant λ, by feature group. Two studies (--study), each with its result JSON:

volume: Calibration at full daily volume: is Θ ever worse than the LM on the day's unseen test articles?

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
Usage: monim bench calibration --study volume [--days 10] [--max-docs N] [--workdir DIR] [--out ...json]

calibrator: The NN calibrator vs constant λ for FullMem, RandMem and MoNIM over days of a real news stream.

Each policy is a run (monim.run.MemoryRun) that learns the days (≤ max-docs training articles a
day) the product's way: `learn` memorizes and calibrates every day (the default calibration:
monim.learning.calibration), RandMem at MoNIM's MemRate (monim.core.catalogue.followed_memrate); each final
memory is evaluated with the constant λ and with the calibrator. FullMem and RandMem (at MoNIM's
rate) do not read Θ while memorizing; MoNIM does, so `--runs monim-amt-const` learns a MoNIM
memory with a constant-λ Θ throughout. On the final memories and all the days' test articles it
prints: PPL with constant λ vs calibrator (the paper's ablation table); the feature-group
ablation (calibrators trained from scratch on MoNIM's calibration set without each group: these
`train_calibrator` calls are the study itself, variants scored beside the memory's own calibrator,
which the days' learning trained; no day reads them); warm-started daily vs retrained; and the
skip rule (θ, decided after a top-16 search) — share skipped, PPL, time saved, measured in this
same run against scoring with full retrieval.
Usage: monim bench calibration --study calibrator [--days 10] [--max-docs 8] [--skip 0.3] [--runs monim-amt,fullmem,randmem,monim-amt-const] [--out ...json]
"""

import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, WORK, first_days, news_parser, save
import numpy as np
from rich.console import Console
from rich.table import Table

from monim.core.catalogue import followed_memrate
from monim.core.config import FEATURE_GROUPS
from monim.core.run_config import RunConfig
from monim.data.feed import Document
from monim.evaluation.evaluate import searched, theta_of
from monim.lm.features import Features
from monim.lm.model import cached_lm
from monim.run import make_run
from monim.theta.calibrator import CalibratorConfig, Examples, examples, train_calibrator
from monim.theta.knnlm import Interpolation, perplexity, theta_scores
from monim.theta.memory import Memory

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


def ppl_of(batches: list, memory: Memory, calibrator=None) -> float:
    """Test PPL under Θ with a given calibrator (its λ per token and its temperature)."""
    nll, n = 0.0, 0
    for b in batches:
        lam = calibrator.lam(examples(b, memory.lexical()))
        nll -= theta_scores(b, Interpolation(0.0, calibrator.temperature), lam).logp.sum()
        n += len(b)
    return math.exp(nll / n)


def timed_score(memory: Memory, docs: list, skip: bool) -> tuple[list, float, float]:
    """The scored batches, the seconds they took, and the share of tokens the skip rule left unsearched."""
    started = time.perf_counter()
    batches = memory.score(docs, skip=skip, retrieve=True)
    skipped = sum(int(b.knn_skipped.sum()) for b in batches if b.knn_skipped is not None)
    return batches, time.perf_counter() - started, skipped / max(1, sum(len(b) for b in batches))


def volume(args) -> None:
    """Per day at full volume, each memory's Θ against the LM on the day's unseen test articles."""
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


def calibrator(args) -> None:
    """Constant λ against the calibrator per policy, the feature-group ablation and the skip rule."""
    days = first_days(args)
    test = [d for day in days for d in day.test]
    console = Console(width=150)
    work = Path(tempfile.mkdtemp(prefix="monim-bench-cal-"))
    results = {"model": cached_lm(args.model).name, "days": [d.date.isoformat() for d in days], "max_docs": args.max_docs,
               "test_articles": len(test), "policies": {}}
    memories: dict[str, Memory] = {}
    for name in args.runs.split(","):
        policy, calibrated = name.removesuffix("-const"), not name.endswith("-const")
        follows = followed_memrate(policy, {p: r["memrate"] for p, r in results["policies"].items()})
        run = make_run(RunConfig(policy=policy, calibrated=calibrated, followed_memrate=follows, workdir=str(work),
                                 model=args.model, max_docs=args.max_docs, feature_store=False,
                                 calibrator={"skip_threshold": args.skip}))
        label, cal_seconds = run.cfg.name, []
        for step, day in enumerate(days):
            row = run.learn(day.capped(run.cfg.max_docs), step)
            summary = run.memory.calibrator().summary  # the calibrator the day's calibration trained
            cal_seconds.append(summary["seconds"])
            console.print(f"{label} {day.date}: stored {row['entries_stored']}/{row['tokens_seen']}, memory {row['entries']}, "
                          f"λ={row['lam']} T={row['temperature']}, calibration set {row['calibration_tokens']} "
                          f"tokens, held-out NLL {summary['held_out_nll']:.4f} "
                          f"(constant λ {summary['held_out_nll_start']:.4f})")
        memory = run.memory
        full, seconds, _ = timed_score(memory, test, skip=False)
        row = {"memrate": memory.ds.memrate, "entries": len(memory), "lam": memory.interpolation.lam,
               "temperature": memory.interpolation.temperature, "bare_ppl": perplexity(full),
               "ppl_constant": perplexity(full, memory.interpolation), "ppl_calibrated": ppl_of(full, memory, memory.calibrator()),
               "score_seconds": seconds, "train_seconds_per_day": float(np.mean(cal_seconds))}
        skipped, skip_seconds, share = timed_score(memory, test, skip=True)
        row |= {"skip_share": share, "ppl_skip": ppl_of(skipped, memory, memory.calibrator()),
                "skip_score_seconds": skip_seconds}
        results["policies"][label] = row
        memories[label] = memory
        console.print(label, row)

    # feature-group ablation and warm start vs retrain, on the calibrated MoNIM's calibration set
    if "monim-amt" in memories:
        memory = memories["monim-amt"]
        calibration = Examples.concat([Examples.load(memory.ds.root / p) for p in memory.calibration_files()])
        full = memory.score(test, skip=False, retrieve=True)
        interp = memory.interpolation
        base = dataclasses.replace(memory.calibrator_cfg, skip_threshold=None)
        ablation = {"all (warm-started daily)": {"ppl": ppl_of(full, memory, memory.calibrator()),
                                                 **memory.calibrator().summary}}
        for label, groups in [("all (retrained from scratch)", FEATURE_GROUPS)] + [
                (f"-{g}", tuple(x for x in FEATURE_GROUPS if x != g)) for g in FEATURE_GROUPS]:
            cal = train_calibrator(calibration, dataclasses.replace(base, groups=groups), interp.lam, interp.temperature)
            ablation[label] = {"ppl": ppl_of(full, memory, cal), **cal.summary}
        ablation["constant λ"] = {"ppl": perplexity(full, interp)}
        results["ablation"] = ablation
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, results, args)

    table = Table(title=f"Test PPL, constant λ vs NN calibrator — {len(days)} days from {days[0].date}, ≤{args.max_docs} articles/day")
    for col in ("policy", "MemRate", "bare LM", "constant λ", "calibrator", f"skip θ={args.skip}: share",
                "PPL", "scoring time ratio"):
        table.add_column(col, justify="right")
    for label, r in results["policies"].items():
        table.add_row(label, f"{r['memrate']:.1%}", f"{r['bare_ppl']:.2f}", f"{r['ppl_constant']:.2f}",
                      f"{r['ppl_calibrated']:.2f}", f"{r['skip_share']:.1%}", f"{r['ppl_skip']:.2f}",
                      f"{r['skip_score_seconds'] / r['score_seconds']:.2f}")
    console.print(table)
    if "ablation" in results:
        table = Table(title="Calibrator features (MoNIM-AMT's memory and calibration set)")
        for col in ("features", "test PPL", "held-out NLL", "train tokens", "epochs", "train seconds"):
            table.add_column(col, justify="right")
        for label, r in ablation.items():
            table.add_row(label, f"{r['ppl']:.3f}", f"{r.get('held_out_nll', math.nan):.4f}", str(r.get("train_tokens", "")),
                          str(r.get("epochs", "")), f"{r.get('seconds', math.nan):.1f}")
        console.print(table)
    console.print(f"wrote {args.out}")
    shutil.rmtree(work, ignore_errors=True)


STUDIES = {"volume": volume, "calibrator": calibrator}


def main(argv: list[str] | None = None) -> None:
    ap = news_parser(__doc__, "calibration")
    ap.add_argument("--study", choices=STUDIES, default="volume")
    ap.set_defaults(out=None, max_docs=None)  # out: docs/results/calibration/calibration-STUDY.json
    ap.add_argument("--workdir", type=Path, default=WORK / "calibration", help="volume: memories and rows (resumable)")
    ap.add_argument("--runs", default=None, help="Comma-separated memories to learn (volume: see RUNS, all of them; "
                    "calibrator: monim-amt,fullmem,randmem, and '<policy>-const' learns with a constant-λ Θ)")
    ap.add_argument("--skip", type=float, default=0.3, help="the skip rule's θ")
    args = ap.parse_args(argv)
    args.out = args.out or RESULTS / "calibration" / f"calibration-{args.study}.json"
    args.runs = args.runs or (",".join(RUNS) if args.study == "volume" else "monim-amt,fullmem,randmem")
    if args.study == "calibrator" and args.max_docs is None:
        args.max_docs = 8
    STUDIES[args.study](args)


if __name__ == "__main__":
    main()
