"""Run the frozen LM over a source's days (every article, every split) into a feature store, ahead
of the runs that read it: a backlog featurized once, in the background or on a bigger machine.
Resumable (the store keeps what is done). Prints each day's tokens and tokens/s.
Usage: python tools/featurize.py --source FILE --start D --end D --store WORKDIR/features [--model M]
"""

import datetime as dt
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages, run as a script
from benchmarks.harness import parser  # noqa: E402  (sets the environment before torch)
from monim.lm.features import Features  # noqa: E402
from monim.lm.model import load_lm  # noqa: E402
from monim.core.config import ScoreConfig  # noqa: E402
from monim.data.day import SPLITS  # noqa: E402
from monim.data.stream import list_dates, read_day  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--source", required=True)
    p.add_argument("--start", type=dt.date.fromisoformat)
    p.add_argument("--end", type=dt.date.fromisoformat)
    p.add_argument("--store", required=True)
    p.add_argument("--model")
    args = p.parse_args(argv)
    features = Features(load_lm(args.model), ScoreConfig(), args.store)
    for date in list_dates(args.source, args.start, args.end):
        day, started = read_day(args.source, date), time.perf_counter()
        tokens = sum(features.prepare(day.split(s), f"{date}-{s}") for s in SPLITS)
        seconds = time.perf_counter() - started
        print(f"{date}: {tokens} tokens in {seconds:.0f} s ({tokens / max(seconds, 1e-9):.0f} tokens/s)", flush=True)


if __name__ == "__main__":
    main()
