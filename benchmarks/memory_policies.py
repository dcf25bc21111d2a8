"""FullMem vs RandMem vs MoNIM-AMT over consecutive days of a real news stream (CPU-sized).

Per policy: cumulative MemRate, test PPL of the bare LM and of LM + memory (constant λ and T tuned
on the validation split), memory bytes, the memorization pass's throughput as a ratio to the bare
LM's forward pass over the same tokens (measured in this same run), and the index update time per
day as the memory grows. Each policy is a run (monim.run.MemoryRun, Θ with the constant λ) that
learns every day the product's way (`learn`: memorize, then calibrate), the LM live (no feature
store, so each pass includes the LM's). RandMem stores at MoNIM's MemRate (monim.core.catalogue.
followed_memrate), so MoNIM runs first.
Usage: monim bench policies [--days 10] [--max-docs 8] [--out ...json]
"""

import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import first_days, news_parser, save
from rich.console import Console
from rich.table import Table

from monim.core.catalogue import followed_memrate
from monim.core.config import RunConfig
from monim.theta.knnlm import perplexity, tune_interpolation
from monim.lm.model import cached_lm
from monim.learning.policies import run_policy
from monim.run import make_run
from monim.lm.scoring import score

POLICIES = ("monim-amt", "fullmem", "randmem")  # the order they learn in: RandMem follows MoNIM's MemRate


def day_stats(date: str, row: dict) -> dict:
    """What memorizing the day did, from the run's row of the day (seconds by stage)."""
    return {"date": date, "tokens_seen": row["tokens_seen"], "stored": row["entries_stored"],
            "memrate": row["memrate_day"], "seconds": {k.removeprefix("seconds_"): v for k, v in row.items()
                                                       if k.startswith("seconds_")}}


def main(argv: list[str] | None = None) -> None:
    ap = news_parser(__doc__, "memory_policies")
    ap.add_argument("--k", type=int, default=1024)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="monim-bench-"))
    config = {"workdir": str(work), "model": args.model, "calibrated": False, "k": args.k,  # constant λ: see calibrator.py
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
    for name in POLICIES:
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


if __name__ == "__main__":
    main()
