"""The LM statistics `monim bench gpu` draws from: each training token's LM log p and max log p (float16)
of a day of RealTime QA, written to benchmarks/data/lm-stats-realtimeqa.npz (one LM pass over the day).
Usage: python tools/lm_stats.py [--start 2022-06-01] [--max-docs N] [--model M] [--npz FILE]
"""

import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages, run as a script
from benchmarks.harness import REPO, RTQA, first_days, parser  # noqa: E402  (sets the environment before torch)
import numpy as np  # noqa: E402

from benchmarks.decision import lm_stats  # noqa: E402
from monim.lm.model import load_lm  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--max-docs", type=int, default=None, help="The day's first N training articles (all).")
    ap.add_argument("--model", default=None)
    ap.add_argument("--npz", type=Path, default=REPO / "benchmarks" / "data" / "lm-stats-realtimeqa.npz")
    args = ap.parse_args(argv)
    args.days = 1
    day = first_days(args)[0]
    logp, max_logp, seconds = lm_stats(load_lm(args.model), day.train[: args.max_docs], f"{day.date}-train")
    args.npz.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.npz, logp=logp.astype(np.float16), max_logp=max_logp.astype(np.float16))
    print(f"wrote {args.npz}: {len(logp):,} tokens of {day.date} ({seconds:.0f} s of LM)")


if __name__ == "__main__":
    main()
