"""How many of a day's training tokens MoNIM must search the memory for: the share whose decision
no memory can change (monim.learning.policies.MoNIM.certain), by the largest λ Θ may give.

From the LM's statistics alone (one LM pass over the day's training articles; no memory needed):
per λ_max, the share of tokens stored for sure, skipped for sure and certain, under AMT (and the
fixed δ for comparison). Writes the JSON and the tokens' LM log p and max log p (float16, npz) for
runs elsewhere to draw which tokens need a search.
Usage: monim bench decision [--start 2022-06-01] [--max-docs N] [--delta -1.5]
"""

import json
import time

from benchmarks.harness import REPO, first_days, news_parser
import numpy as np
from rich.console import Console
from rich.table import Table

from monim.theta.calibrator import LAM_CEIL
from monim.lm.features import Features
from monim.lm.model import load_lm
from monim.learning.policies import MoNIM
from monim.core.config import ScoreConfig

LAM_MAXES = (0.1, 0.25, 0.5, LAM_CEIL)


def main(argv: list[str] | None = None) -> None:
    ap = news_parser(__doc__.splitlines()[0], "decision-skip")
    ap.set_defaults(days=1, max_docs=None)
    ap.add_argument("--delta", type=float, default=-1.5)
    ap.add_argument("--npz", default=REPO / "benchmarks" / "data" / "lm-stats-realtimeqa.npz")
    args = ap.parse_args(argv)
    lm = load_lm(args.model)
    day = first_days(args)[0]
    docs = day.train[: args.max_docs]
    started = time.perf_counter()
    batches = list(Features(lm, ScoreConfig()).scores(docs, f"{day.date}-train"))
    seconds = time.perf_counter() - started
    logp = np.concatenate([b.logp for b in batches])
    max_logp = np.concatenate([b.max_logp for b in batches])
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": lm.name, "date": day.date.isoformat(), "articles": len(docs),
                                    "articles_in_day": len(day.train), "tokens": len(logp), "delta": args.delta,
                                    "lm_seconds": seconds, "rows": rows}, indent=1) + "\n")
    np.savez_compressed(args.npz, logp=logp.astype(np.float16), max_logp=max_logp.astype(np.float16))
    print(f"wrote {args.out} and {args.npz}")


if __name__ == "__main__":
    main()
