"""The parametric learners' learning rate, chosen on validation data (the paper gives none).

Each rate fine-tunes the pretrained LM on the first day's first --train-tokens training tokens
(as `--policy finetune` does on its first day); the PPL of the validation articles of the first
--days days is measured after it (never the test articles, which the report scores), beside the
pretrained LM's and the seconds and tokens/s of training.
Usage: monim bench learner-lr [--rates 1e-5,3e-5,1e-4,3e-4] [--train-tokens 4096] [--days 10]
"""

import time

from benchmarks.harness import first_days, news_parser, save
from rich.console import Console
from rich.table import Table

from monim.evaluation.evaluate import evaluate
from monim.lm.model import load_lm
from monim.learning.parametric import Learner, train_day, trained_copy
from monim.core.config import ScoreConfig


def main(argv: list[str] | None = None) -> None:
    ap = news_parser(__doc__, "learner-lr")
    ap.add_argument("--rates", default="1e-5,3e-5,1e-4,3e-4")
    ap.add_argument("--train-tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    days = first_days(args)
    validation = [d for day in days for d in day.validation]
    base = load_lm(args.model)
    bare = evaluate(base, validation, None, ScoreConfig())
    rows = [{"lr": 0.0, "validation_ppl": bare["ppl"], "seconds": 0.0, "tokens_per_s": 0.0}]
    for lr in map(float, args.rates.split(",")):
        lm = trained_copy(base)
        started = time.perf_counter()
        stats = train_day(lm, days[0].train, Learner(lr=lr, train_tokens=args.train_tokens), 0, 0)
        seconds = time.perf_counter() - started
        rows.append({"lr": lr, "validation_ppl": evaluate(lm, validation, None, ScoreConfig())["ppl"],
                     "seconds": seconds, "tokens_per_s": stats["tokens_trained"] / seconds})
        del lm
    table = Table(title=f"fine-tuning on {days[0].date} ({args.train_tokens} tokens); validation: "
                        f"{len(validation)} articles, {bare['tokens']} tokens of {len(days)} days")
    for col in ("lr (0: pretrained)", "validation PPL", "train s", "tokens/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['lr']:g}", f"{r['validation_ppl']:.2f}", f"{r['seconds']:.0f}", f"{r['tokens_per_s']:.0f}")
    Console().print(table)
    best = min(rows[1:], key=lambda r: r["validation_ppl"])
    print(f"best lr: {best['lr']:g}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, {"rows": rows, "best_lr": best["lr"], "validation_tokens": bare["tokens"]}, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
