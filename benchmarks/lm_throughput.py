"""LM forward throughput (tokens/s) for fp32/bf16 x batch 1/8, as ratios to fp32 batch 1.

Measures the model body alone and full scoring (body + per-token stats over the vocabulary) on
512-token windows of WikiText, all in one process so the ratios compare like with like.
Usage: monim bench lm-throughput [--reps 2] [--out docs/results/lm-throughput/lm-throughput.json]
"""

import datetime as dt
import time
from pathlib import Path

from benchmarks.harness import DATA, parser, save
import torch
from rich.console import Console
from rich.table import Table

from monim.lm.model import load_lm
from monim.core.config import ScoreConfig
from monim.lm.scoring import score
from monim.data.feed import Document


def timed(fn, reps: int) -> float:
    """Best wall time of `reps` runs after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "lm-throughput")
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--data", type=Path, default=DATA)
    args = ap.parse_args(argv)

    text = (args.data / "wikitext" / "wiki.test.raw").read_text(encoding="utf-8")[:60000]
    rows = []
    for dtype in ("float32", "bfloat16"):
        lm = load_lm(args.model, dtype=dtype)
        ids = torch.tensor(lm.tokenizer(text)["input_ids"][: 8 * 512]).view(8, 512)
        for batch in (1, 8):
            x = ids[:batch].to(lm.device)
            with torch.inference_mode():
                body = timed(lambda: lm.forward(x, torch.ones_like(x)), args.reps)
            docs = [Document(f"w{i}", dt.date(2020, 1, 1), lm.tokenizer.decode(ids[i])) for i in range(batch)]
            cfg = ScoreConfig(stride=512, context=0, batch_size=batch)
            n_scored = sum(len(b) for b in score(lm, docs, cfg))
            full = timed(lambda: sum(len(b) for b in score(lm, docs, cfg)), args.reps)
            rows.append({"dtype": dtype, "batch": batch, "tokens": batch * 512,
                         "body_tokens_per_s": batch * 512 / body, "score_tokens_per_s": n_scored / full})
    base = rows[0]
    for r in rows:
        r["body_ratio"] = r["body_tokens_per_s"] / base["body_tokens_per_s"]
        r["score_ratio"] = r["score_tokens_per_s"] / base["score_tokens_per_s"]

    table = Table(title=f"LM throughput, {torch.get_num_threads()} threads, {lm.device} (ratios vs fp32 batch 1)")
    for col in ("dtype", "batch", "body tok/s", "ratio", "score tok/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["dtype"], str(r["batch"]), f"{r['body_tokens_per_s']:.0f}", f"{r['body_ratio']:.2f}",
                      f"{r['score_tokens_per_s']:.0f}", f"{r['score_ratio']:.2f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, {"model": lm.name, "threads": torch.get_num_threads(), "rows": rows}, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
