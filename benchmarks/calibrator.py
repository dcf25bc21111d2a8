"""The NN calibrator vs constant λ for FullMem, RandMem and MoNIM over days of a real news stream.

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
Usage: monim bench calibrator [--days 10] [--max-docs 8] [--skip 0.3] [--runs monim-amt,fullmem,randmem,monim-amt-const] [--out ...json]
"""

import dataclasses
import math
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import first_days, news_parser, save
import numpy as np
from rich.console import Console
from rich.table import Table

from monim.theta.calibrator import Examples, examples, train_calibrator
from monim.core.config import FEATURE_GROUPS
from monim.core.catalogue import followed_memrate
from monim.core.config import RunConfig
from monim.theta.knnlm import Interpolation, perplexity, theta_scores
from monim.lm.model import cached_lm
from monim.theta.memory import Memory
from monim.run import make_run


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


def main(argv: list[str] | None = None) -> None:
    ap = news_parser(__doc__, "calibrator")
    ap.add_argument("--skip", type=float, default=0.3)
    ap.add_argument("--runs", default="monim-amt,fullmem,randmem",
                    help="Memories to learn; '<policy>-const' learns with a constant-λ Θ (matters for MoNIM).")
    args = ap.parse_args(argv)

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
            ablation[label] = {"ppl": ppl_of(full, memory, cal), **cal.record}
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


if __name__ == "__main__":
    main()
